"""titan_fold's [optimizer] section: torchtitan's keys, the master weights and Muon's settings."""

from dataclasses import dataclass, field
from typing import Literal

from torchtitan.config.job_config import Optimizer as TitanOptimizer


@dataclass
class Optimizer(TitanOptimizer):
    name: Literal["Adam", "AdamW", "Muon"] = "AdamW"
    """Adam, AdamW, or Muon: Muon for the hidden matrices, AdamW for the rest (titan_fold/trainer/muon.py)."""
    master_weights: bool = False
    """Keep fp32 master weights and fp32 optimizer states in the optimizer while the model's
    parameters are bf16 (training.dtype = "bfloat16"): bf16 compute without autocast, the
    fp32 recipe's update (titan_fold/trainer/optimizer.py)."""
    muon_momentum: float = 0.95
    """With name = "Muon": the momentum of the matrices' updates (titan_fold/trainer/muon.py)."""
    muon_nesterov: bool = True
    """With name = "Muon": orthogonalize the gradient plus momentum times the buffer's step (Nesterov)
    rather than the buffer."""
    muon_ns_steps: int = 5
    """With name = "Muon": Newton-Schulz iterations per orthogonalization."""
    muon_ns_coefficients: list[float] = field(default_factory=lambda: [3.4445, -4.775, 2.0315])
    """With name = "Muon": the coefficients (a, b, c) of the quintic Newton-Schulz iteration
    X <- a X + (b A + c A^2) X, A = X X^T."""
    muon_lr_adjust: Literal["match_rms_adamw", "original"] = "match_rms_adamw"
    """With name = "Muon": the factor of lr on a matrix [A, B]'s orthogonalized update:
    0.2 sqrt(max(A, B)) (Moonlight's: the update's RMS that of AdamW, so AdamW's lr and weight decay
    carry over), or sqrt(max(1, A / B)) (Keller Jordan's original)."""
    muon_ns_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """With name = "Muon": the dtype Newton-Schulz computes in (torch.optim.Muon's: bfloat16)."""
