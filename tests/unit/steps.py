"""Step events for the detectors' tests: the fields they read, with defaults for the rest."""
from contracts.protocol import StepEvent


def step_event(*, step: int, loss: float, grad_norm: float = 1.0, loss_scale: float = 1.0, skipped: bool = False,
               tokens_per_s: float = 10000.0, rank: int = 0, generation: int = 1, step_s: float = 0.01) -> StepEvent:
    return StepEvent(rank=rank, generation=generation, step=step, loss=loss, grad_norm=grad_norm,
                     loss_scale=loss_scale, lr=1e-3, lr_multiplier=1.0, skipped=skipped, sample_start=8 * (step - 1),
                     sample_end=8 * step, tokens=512, step_s=step_s, data_wait_s=0.0, tokens_per_s=tokens_per_s)
