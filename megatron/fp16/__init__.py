from .fp16 import FP16_Optimizer
from megatron.zero.loss_scaler import LossScaler, LossScalerConfig
