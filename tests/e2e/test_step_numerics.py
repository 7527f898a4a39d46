"""The compiled step on real MindSpore: it learns, and it never applies a non-finite gradient."""
import numpy as np
import pytest

from tests.e2e.conftest import snapshot

INF = float("inf")


def test_tiny_config_learns(make_trainer):
    trainer = make_trainer()
    losses = [trainer.train_step().loss for _ in range(200)]
    first, last = np.mean(losses[:10]), np.mean(losses[190:200])
    print(f"mean loss steps 1-10: {first:.4f}, steps 191-200: {last:.4f} ({1 - last / first:.0%} lower)")
    assert last <= 0.7 * first


def _scaler_keys(state):
    return {k for k in state if k.startswith("loss_scale")}


def test_fp16_injected_inf_skips_update_and_halves_scale(make_trainer):
    trainer = make_trainer('train.precision="fp16"')
    for _ in range(3):
        trainer.train_step()
    before = snapshot(trainer)
    scale = float(before["loss_scale"])
    event = trainer.train_step(poison=INF)
    after = snapshot(trainer)
    assert event.skipped and event.loss_scale == scale
    for name in before.keys() - _scaler_keys(before):
        assert np.array_equal(before[name], after[name]), f"{name} changed on a skipped step"
    assert float(after["loss_scale"]) == scale / 2
    assert int(after["loss_scale_good_steps"]) == 0
    nxt = trainer.train_step()
    assert nxt.loss_scale == scale / 2 and not nxt.skipped
    assert int(snapshot(trainer)["adam_step"]) == int(before["adam_step"]) + 1


def test_fp16_trains_with_scaled_loss(make_trainer):
    trainer = make_trainer('train.precision="fp16"')
    events = [trainer.train_step() for _ in range(30)]
    assert sum(not e.skipped for e in events) >= 25
    assert events[-1].loss < events[0].loss


def test_fp32_injected_inf_skips_update_reports_it_and_keeps_scale_one(make_trainer):
    trainer = make_trainer()
    trainer.train_step()
    before = snapshot(trainer)
    event = trainer.train_step(poison=INF)
    after = snapshot(trainer)
    assert event.skipped and event.loss_scale == 1.0 and not np.isfinite(event.grad_norm)
    for name in before:
        assert np.array_equal(before[name], after[name]), f"{name} changed on a skipped step"
    nxt = trainer.train_step()
    assert not nxt.skipped and nxt.loss_scale == 1.0 and np.isfinite(nxt.grad_norm)


@pytest.mark.parametrize("layers", [0, 1])   # 0 = every layer
def test_recompute_gives_the_same_losses(make_trainer, layers):
    plain = make_trainer()
    recomputed = make_trainer("train.recompute=true", f"train.recompute_num_layers={layers}")
    flags = [getattr(l, "_recompute_cell", None) is not None for l in recomputed.net.model.layers]
    assert flags == ([True, True] if layers == 0 else [True, False])
    for _ in range(5):
        a, b = plain.train_step(), recomputed.train_step()
        assert b.loss == pytest.approx(a.loss, abs=1e-5)
        assert b.grad_norm == pytest.approx(a.grad_norm, rel=1e-5)


def test_accumulated_micro_batches_match_one_big_batch(make_trainer, mindspore_cpu):
    """Gradients of k=4 accumulated micro-batches of b=2 equal those of one batch of 8 (rel 1e-5)."""
    ms = mindspore_cpu
    k, b = 4, 2
    accum = make_trainer(f"train.micro_batch={b}", f"train.grad_accum_steps={k}")
    whole = make_trainer()
    batch = whole.source.batch(np.arange(k * b).reshape(1, k * b))
    one = ms.jit(whole.step_fn._backward)
    _, grads = one(ms.Tensor(batch[0]), ms.Tensor(1.0, ms.float32))
    for micro in batch.reshape(k, b, -1):
        accum.step_fn._accumulate(ms.Tensor(micro), ms.Tensor(1.0, ms.float32))
    for ref, buf in zip(grads, accum.step_fn.grad_buffers):
        ref, got = ref.asnumpy(), buf.asnumpy() / k
        assert np.linalg.norm(got - ref) <= 1e-5 * np.linalg.norm(ref), buf.name


def test_accumulated_step_matches_single_step(make_trainer):
    accum = make_trainer("train.micro_batch=2", "train.grad_accum_steps=4")
    whole = make_trainer()
    for _ in range(3):
        a, w = accum.train_step(), whole.train_step()
        assert a.loss == pytest.approx(w.loss, rel=1e-5)
        assert a.grad_norm == pytest.approx(w.grad_norm, rel=1e-5)
        assert (a.sample_start, a.sample_end) == (w.sample_start, w.sample_end)


@pytest.mark.parametrize("overrides", [['model.arch="gpt2"'], ["model.tie_embeddings=true"],
                                       ["model.num_kv_heads=1"]])
def test_model_variants_learn(make_trainer, overrides):
    trainer = make_trainer(*overrides)
    losses = [trainer.train_step().loss for _ in range(40)]
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.3


RECOVERY = dict(checkpoint_step=50, loss_scale=1024.0, loss_scale_cap=1024.0, loss_scale_cap_until_step=1050)


@pytest.mark.parametrize("recovery,restored,step,plan", [
    (RECOVERY, 50, 50, (1024.0, 1024.0, 1050)),         # the rollback target itself: restart, capped
    (RECOVERY, 60, 60, (None, 1024.0, 1050)),           # a later restart: keep the saved scale, still capped
    (RECOVERY, 1050, 1050, (None, None, 0)),            # past the cap's end: uncapped
    ({"checkpoint_step": 50}, 50, 50, (None, None, 0)),  # a rollback that left the scale alone
    ({**RECOVERY, "loss_scale": None}, 50, 50, (None, 1024.0, 1050)),
])
def test_what_a_recovery_asks_of_the_loss_scaler(recovery, restored, step, plan):
    from contracts.protocol import RecoveryDirective
    from engine.training.loss_scale import after_recovery

    assert after_recovery(RecoveryDirective(**recovery), restored_step=restored, step=step) == plan


def test_a_recovery_restarts_caps_and_then_lifts_the_fp16_scale(make_trainer):
    from contracts.protocol import RecoveryDirective

    trainer = make_trainer('train.precision="fp16"', "train.loss_scale_window_steps=2")
    recovery = RecoveryDirective(checkpoint_step=0, loss_scale=8.0, loss_scale_cap=16.0, loss_scale_cap_until_step=6)
    assert trainer.apply_recovery(recovery, restored_step=0) == 6
    capped = [trainer.train_step() for _ in range(6)]
    assert not any(e.skipped for e in capped)
    assert [e.loss_scale for e in capped] == [8.0, 8.0, 16.0, 16.0, 16.0, 16.0]   # doubles every 2, up to 16
    trainer.lift_loss_scale_cap()
    assert [trainer.train_step().loss_scale for _ in range(3)] == [16.0, 16.0, 32.0]


def test_fp32_ignores_the_loss_scale_part_of_a_recovery(make_trainer):
    from contracts.protocol import RecoveryDirective

    trainer = make_trainer()
    assert trainer.apply_recovery(RecoveryDirective(**RECOVERY), restored_step=50) == 0
    state = snapshot(trainer)
    assert float(state["loss_scale"]) == 1.0 and float(state["loss_scale_cap"]) == INF
    assert trainer.train_step().loss_scale == 1.0
