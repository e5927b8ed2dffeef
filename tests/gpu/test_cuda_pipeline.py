"""The CUDA path, on a machine with a GPU (skipped elsewhere; this project's CI has none).

Run it on its own — ``pytest tests/gpu`` — not together with ``tests/kernels``, whose conftest
switches Triton to its CPU interpreter for the whole session. Every stage runs in this process on
one GPU (``device="cuda"``): stages, flat weight versions, batches and the loss live there, and
``kernels="auto"`` takes the fused Triton gradient accumulation and update (float64 models fall
back to torch.optim, which the tests assert). The numbers must equal the references trained on
the same GPU, as on the CPU.
"""

import pytest
import torch

import fxpipe
from tests.cases import CASES, build, compare

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU, and a run of tests/gpu on its own (pytest tests/gpu)")


# zb: on CUDA autograd runs the backward on a device thread, where fxpipe's saved-tensor bookkeeping
# for the split backward (fxpipe.backward.SavedTensors) must hold as on the CPU
@pytest.mark.parametrize("name", ["2bw_adamw_clip", "2bw_sgd", "1f1b_adamw", "gpt2_2bw", "llama_2bw_adamw",
                                  "zb_adamw_clip", "gpt2_zb", "i2_adamw_clip"])
def test_cuda_pipeline_matches_the_reference_on_the_gpu(name):
    case = CASES[name]
    model, example, batches, loss_fn, opt = build(case)
    pipe = fxpipe.compile(
        model, example, loss_fn=loss_fn, optimizer=opt, microbatches=case.microbatches, schedule=case.schedule,
        stages=case.stages, max_grad_norm=case.max_grad_norm, device="cuda", verbose=False, chunks=case.chunks,
    )
    assert pipe.device.type == "cuda"
    # float32 cases take the fused Triton update; the float64 ones fall back to torch.optim
    path = "torch.optim" if case.dtype == torch.float64 else "fused (triton)"
    assert f"stage 0 {path}, stage 1 {path}" in pipe.describe()
    losses = [pipe.step(x, y, sync=False) for x, y in batches]
    assert all(isinstance(v, torch.Tensor) and v.device.type == "cuda" for v in losses)
    mismatches = compare(case, [float(v) for v in losses], pipe.state_dict(), device="cuda")
    assert not mismatches, "\n".join(mismatches)


def test_cuda_zb_weight_pass_computes_its_anchors_gradients_bit_for_bit_as_autograd():
    # W computes these on the calling thread and its current stream, not on autograd's device thread
    from tests.unit.test_zero_bubble import check_w_formulas

    check_w_formulas("cuda")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
@pytest.mark.timeout(600)
def test_nccl_ranks_match_the_reference():
    # One process per GPU, NCCL between them, exactly as under torchrun.
    from tests.dist.test_pipeline_dist import check_cases

    # i2_*: interleaved 1F1B, every channel between the two GPUs on one NCCL stream (docs/design.md)
    check_cases(2, ["2bw_adamw_clip", "1f1b_adamw", "gpt2_2bw", "llama_2bw_adamw", "i2_gpt2_1f1b", "i2_adamw_clip"], 500,
                backend="nccl")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
@pytest.mark.timeout(600)
def test_nccl_script_that_ends_without_flush_exits_on_every_rank():
    # The exit path under NCCL, as torchrun runs a script: fxpipe creates the group ("auto" picks
    # cuda:LOCAL_RANK), and at exit each rank drains, meets the others in the store and destroys
    # the group (fxpipe.pipeline._finish_at_exit). On gloo the meeting removed an abort at
    # exit seen in about one run in eight; five runs here.
    from tests.dist.test_reliability import _run_script

    for _ in range(5):
        ranks = _run_script(fail=False)
        assert [r.returncode for r in ranks] == [0, 0], "\n".join(r.stdout[-2000:] for r in ranks)
        assert "rank 0 ends with" in ranks[0].stdout and "rank 1 ends with" in ranks[1].stdout


@pytest.mark.parametrize("schedule,precision", [("2bw", "fp32"), ("1f1b", "fp32"), ("2bw", "bf16"), ("zb", "fp16")])
def test_cuda_resume_is_bitwise_the_uninterrupted_run(tmp_path, schedule, precision):
    # Checkpoints of GPU stages (fused optimizer state, CUDA RNG; under bf16/fp16 the master
    # weights and, for fp16, the loss scale) resume bit for bit.
    from tests import resume

    def run(start, steps, **io):
        return resume.run(resume.compile(schedule, 2, 2, kernels="auto", device="cuda", precision=precision),
                          start, steps, **io)

    full = run(0, 6)
    run(0, 3, save=str(tmp_path))
    resumed = run(3, 3, load=str(tmp_path))
    assert resumed["losses"] == full["losses"][3:]
    assert all(torch.equal(v, resumed["state"][k]) for k, v in full["state"].items())


@pytest.mark.parametrize("flag", ["fused", "capturable"])
def test_cuda_resume_of_torch_optims_fused_or_capturable_adamw_is_bitwise(tmp_path, flag):
    # torch.optim keeps such a group's ``step`` as a float32 on the GPU; the loaded state must too
    import functools

    from tests import resume

    opt = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1, **{flag: True})

    def run(start, steps, **io):
        return resume.run(resume.compile("2bw", 2, 2, kernels="off", device="cuda", optimizer=opt), start, steps, **io)

    full = run(0, 6)
    run(0, 3, save=str(tmp_path))
    resumed = run(3, 3, load=str(tmp_path))
    assert resumed["losses"] == full["losses"][3:]
    assert all(torch.equal(v, resumed["state"][k]) for k, v in full["state"].items())


def test_cuda_nonfinite_gradient_is_skipped_everywhere(monkeypatch):
    # The non-finite flag is read on the host at NORM_WAIT; on the GPU that is a sync, not a hang.
    from fxpipe.runtime import StageWorker
    from tests import resume

    monkeypatch.setattr(StageWorker, "_do_b", resume.poisoning(StageWorker._do_b))
    pipe = resume.compile("2bw", 3, 4, dropout=0.0, kernels="auto", device="cuda", nonfinite="skip")
    with pytest.warns(RuntimeWarning, match=r"step 3: stage\(s\) \[1\]"):
        for t in range(1, 7):
            pipe.step(*resume.batch(t))
    assert pipe.skipped_steps == [3]


def _to_cuda(batches):
    """(inputs, target) pairs with every tensor (also in tuples and dicts) on the GPU."""
    import torch.utils._pytree as pytree

    return pytree.tree_map(lambda x: x.cuda() if isinstance(x, torch.Tensor) else x, batches)


@pytest.mark.parametrize("model_name,schedule,precision", [("gpt", "2bw", "bf16"), ("gpt2", "1f1b", "bf16"),
                                                           ("llama", "2bw", "bf16"), ("gpt", "zb", "bf16"),
                                                           ("llama", "zb", "fp16"), ("gpt2", "1f1b", "fp16")])
def test_cuda_mixed_precision_matches_the_reference_under_cudas_policy(model_name, schedule, precision):
    # On CUDA autocast keeps softmax, layer_norm and the losses in fp32 (CPU's list differs): the
    # reference runs on the same GPU under the same device type's policy. fp16 scales the loss
    # with a GradScaler("cuda")'s settings, the reference with the same rule.
    from tests.cases import build_mixed, relative_update_error
    from tests.reference import train_mixed
    from tests.unit.test_precision import DTYPES, SCALER

    net, example, batches, loss_fn, opt = build_mixed(model_name)
    net, batches = net.cuda(), _to_cuda(batches)
    example = _to_cuda([(example, None)])[0][0]
    initial = {n: p.detach().clone() for n, p in net.named_parameters()}
    scaler = torch.amp.GradScaler("cuda", init_scale=SCALER[0]) if precision == "fp16" else None
    pipe = fxpipe.compile(net, example, loss_fn=loss_fn, optimizer=opt, microbatches=4, stages=2, schedule=schedule,
                          precision=precision, scaler=scaler, device="cuda", verbose=False)
    assert "stage 0 fused (triton), stage 1 fused (triton)" in pipe.describe()
    store = pipe.workers[0].store
    assert store.master[torch.float32].device.type == "cuda"
    assert {b.dtype for slot in store.slots for b in slot.values()} == {DTYPES[precision]}
    losses = [pipe.step(*b) for b in batches]
    ref_losses, ref, skipped = train_mixed(net, batches, 4, loss_fn, opt, dtype=DTYPES[precision], schedule=schedule,
                                           device_type="cuda", scaler=SCALER if scaler else None)
    assert pipe.skipped_steps == skipped
    error = relative_update_error(initial, pipe.state_dict(), dict(ref.named_parameters()))
    print(f"{model_name} {schedule} {precision}: relative update error {error:.2e}")
    assert error <= 0.05, error
    assert all(abs(a - b) <= 1e-2 * abs(b) for a, b in zip(losses, ref_losses)), (losses, ref_losses)


def test_cuda_leaf_modules_train_as_eager_autocast():
    # Leaf modules under bf16 on the GPU: one whose output dtype comes from its own parameter,
    # one holding a BatchNorm (its weights stay fp32), one that branches on values (annotated by
    # running it once on zeros, on the stage's device), against eager autocast on the same GPU.
    import functools

    import torch.nn.functional as F

    from fxpipe import precision as precision_module
    from tests.cases import relative_update_error
    from tests.reference import train_mixed
    from tests.unit.test_precision import _Gain, _LinBN, _Router

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), _Gain(), _LinBN(), _Router(), _Gain(),
                              torch.nn.Linear(16, 4)).cuda()
    g = torch.Generator().manual_seed(5)
    batches = _to_cuda([(torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(5)])
    low = {n for n, _ in net.named_parameters()} - {"2.bn.weight", "2.bn.bias"}
    opt = functools.partial(torch.optim.AdamW, lr=1e-2)
    initial = {n: p.detach().clone() for n, p in net.named_parameters()}
    pipe = fxpipe.compile(net, (batches[0][0][:2],), loss_fn=F.cross_entropy, optimizer=opt, microbatches=4, stages=2,
                          precision="bf16", device="cuda", leaf_modules=(_Gain, _LinBN, _Router), verbose=False)
    assert "stage 0 fused (triton), stage 1 fused (triton)" in pipe.describe()
    losses = [pipe.step(*b) for b in batches]
    ref_losses, ref, skipped = train_mixed(net, batches, 4, F.cross_entropy, opt, dtype=torch.bfloat16,
                                           device_type="cuda", cast_params=low)
    assert skipped == pipe.skipped_steps == []
    error = relative_update_error(initial, pipe.state_dict(), dict(ref.named_parameters()))
    print(f"leaf modules bf16: relative update error {error:.2e}")
    assert error <= 1e-2, error
    assert all(abs(a - b) <= 1e-3 * abs(b) for a, b in zip(losses, ref_losses)), (losses, ref_losses)
    sd = pipe.state_dict()
    for name, buf in ref.named_buffers():  # the statistics moved as eager's did
        assert torch.allclose(sd[name].float(), buf.float().cpu(), rtol=1e-3, atol=1e-4), name
    assert precision_module.fp32_params(pipe.staged_graph) == {"2.bn.weight", "2.bn.bias"}


def test_cuda_eval_step_runs_modules_in_eval_mode_as_eager():
    # eval_step on the GPU: leaf modules with BatchNorm (running statistics, not moved) and dropout
    # (off), against the trained weights evaluated eagerly.
    import functools

    from tests.unit.test_pipeline import _eager_eval_loss

    nn = torch.nn
    torch.manual_seed(0)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.norm, self.drop = nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Dropout(0.5)

        def forward(self, x):
            return self.drop(torch.relu(self.norm(self.lin(x))))

    model = nn.Sequential(nn.Linear(8, 16), Block(), Block(), nn.Linear(16, 4))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
    pipe = fxpipe.compile(model, (x[:4],), loss_fn=nn.functional.mse_loss, microbatches=4, stages=2, schedule="1f1b",
                          optimizer=functools.partial(torch.optim.SGD, lr=0.1), leaf_modules=[Block], device="cuda",
                          verbose=False)
    for _ in range(3):
        pipe.step(x, y)
    trained = pipe.state_dict()
    got = pipe.eval_step(x, y)
    assert pipe.eval_step(x, y) == got  # no dropout
    assert all(torch.equal(pipe.state_dict()[k], t) for k, t in trained.items())  # no statistics moved
    expected = _eager_eval_loss(model.cuda(), trained, nn.functional.mse_loss, x.cuda(), y.cuda())
    assert got == pytest.approx(expected, rel=1e-5)


def test_cuda_parameter_groups_take_the_fused_triton_update():
    # AdamW with a decay/no-decay group factory: one launch per run of a group's parameters.
    case = CASES["2bw_groups"]
    model, example, batches, loss_fn, opt = build(case)
    pipe = fxpipe.compile(model, example, loss_fn=loss_fn, optimizer=opt, microbatches=case.microbatches,
                          schedule=case.schedule, stages=case.stages, device="cuda", verbose=False)
    assert "stage 0 fused (triton), stage 1 fused (triton)" in pipe.describe()
    losses = [pipe.step(x, y) for x, y in batches]
    mismatches = compare(case, losses, pipe.state_dict(), device="cuda")
    assert not mismatches, "\n".join(mismatches)


def test_cuda_adama_takes_its_triton_kernels():
    from tests.cases import relative_update_error
    from tests.reference import train_adama
    from tests.unit import test_optimizer_accumulation as test_adama

    net, batches = test_adama.gpt()
    net, batches = net.cuda(), _to_cuda(batches)
    initial = {n: p.detach().clone() for n, p in net.named_parameters()}
    pipe = test_adama.compile_adama(net, batches, device="cuda")
    assert "stage 0 AdamA (triton), stage 1 AdamA (triton)" in pipe.describe()
    for b in batches:
        pipe.step(*b)
    _, ref = train_adama(net, batches, 4, test_adama.lm_loss, lr=test_adama.LR, weight_decay=test_adama.WD)
    assert relative_update_error(initial, pipe.state_dict(), dict(ref.named_parameters())) <= 1e-4


@pytest.mark.parametrize("cost_mode", ["calibrated", "measured"])
def test_cuda_costs_time_a_model_built_on_the_cpu_on_the_gpu(cost_mode):
    # The model is built on the CPU, as a model too large for one GPU is; the costs are timed on a
    # copy on the GPU (fxpipe.device.moved_copy), where the demo GPT's positions and causal mask,
    # which its trace bakes on the CPU, must follow it. "calibrated": the whole model, then every
    # node alone forward and backward (calibrate._roofs, the device synchronised around each), give both
    # roofs and both backward ratios; "measured" runs every node there. Either plan trains as the
    # reference does.
    case = CASES["2bw_adamw_clip"]
    model, example, batches, loss_fn, opt = build(case)
    pipe = fxpipe.compile(model, example, loss_fn=loss_fn, optimizer=opt, microbatches=case.microbatches,
                          schedule=case.schedule, stages=case.stages, max_grad_norm=case.max_grad_norm, device="cuda",
                          cost_mode=cost_mode, verbose=False)
    if cost_mode == "calibrated":
        dev = pipe.plan.device
        assert dev.backward_ratio_bytes is not None
        assert all(v > 0 for v in (dev.peak_flops, dev.mem_bandwidth, dev.backward_ratio, dev.backward_ratio_bytes))
    losses = [pipe.step(x, y) for x, y in batches]
    mismatches = compare(case, losses, pipe.state_dict(), device="cuda")
    assert not mismatches, "\n".join(mismatches)
