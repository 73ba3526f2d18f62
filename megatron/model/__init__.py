from .distributed import DistributedDataParallel
from .gpt2_model import GPT2Model, GPT2ModelConfig
