from .fp16 import FP16_Optimizer
from .loss_scaler import LossScaler, LossScalerConfig
