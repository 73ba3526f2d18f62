"""`deepspeed.get_accelerator()`: DeepSpeed's device object, answered from mpu's one choice of device and backend.

    device = torch.device(get_accelerator().device_name())      # "cuda" or "cpu"
    get_accelerator().current_device_name()                       # "cuda:1" or "cpu"
    get_accelerator().empty_cache()

On CUDA the answers are torch.cuda's; on the CPU those of DeepSpeed's CPU accelerator (device_name "cpu", the
device index LOCAL_RANK, nothing to synchronize or free).
"""
import os

import torch

from mpu import get_backend, get_device


class Accelerator:
    """The subset of DeepSpeed's accelerator interface its clients call."""

    def _cuda(self):
        return get_device().type == "cuda"

    def device_name(self, device_index=None):
        name = get_device().type
        return name if device_index is None or not self._cuda() else f"{name}:{device_index}"

    def current_device(self):
        return torch.cuda.current_device() if self._cuda() else int(os.environ.get("LOCAL_RANK", 0))

    def current_device_name(self):
        return f"cuda:{torch.cuda.current_device()}" if self._cuda() else "cpu"

    def device(self, device_index=None):
        return torch.device(self.device_name(device_index))

    def set_device(self, device_index):
        if self._cuda():
            torch.cuda.set_device(device_index)

    def device_count(self):
        return torch.cuda.device_count() if self._cuda() else int(os.environ.get("LOCAL_WORLD_SIZE", 1))

    def is_available(self):
        return True

    def synchronize(self, device_index=None):
        if self._cuda():
            torch.cuda.synchronize(device_index)

    def empty_cache(self):
        if self._cuda():
            torch.cuda.empty_cache()

    def manual_seed(self, seed):
        (torch.cuda.manual_seed if self._cuda() else torch.manual_seed)(seed)

    def manual_seed_all(self, seed):
        (torch.cuda.manual_seed_all if self._cuda() else torch.manual_seed)(seed)

    def communication_backend_name(self):
        return get_backend()

    def is_bf16_supported(self):
        return torch.cuda.is_bf16_supported() if self._cuda() else True

    def is_fp16_supported(self):
        return self._cuda()

    def on_accelerator(self, tensor):
        return tensor.device.type == get_device().type


_ACCELERATOR = Accelerator()


def get_accelerator():
    return _ACCELERATOR
