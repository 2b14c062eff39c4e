"""The benchmark behind `neptune-fusion bench`: the operators of DESIGN.md section 5 and the
reduction chains beyond attention, each correct against fp32 and timed beside its baselines
(FlashAttention-4, FlexAttention's FLASH and Triton backends, SDPA, torch.compile) in one process.

`cases` says what is measured, `runner` how, `report` how it is written out.
"""

from neptune_fusion.benchmarks.cases import SUITES, select
from neptune_fusion.benchmarks.runner import run

__all__ = ["SUITES", "run", "select"]
