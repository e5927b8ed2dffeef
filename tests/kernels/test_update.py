"""The fused 2BW update vs torch.optim over several steps, and vs its reference per dtype."""
import functools

import pytest
import torch
from conftest import DTYPES, LENGTHS, TOL

from fxpipe.kernels import KernelError, OptimizerSpec, init_state, ops, update_reference
from fxpipe.kernels.update import update

SHAPES = [(7, 5), (13,), (3, 4, 2), (1,)]  # a few parameters, flattened into one stage buffer
OPTIMIZERS = {
    "sgd": functools.partial(torch.optim.SGD, lr=0.1),
    "sgd-momentum-dampening": functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9, dampening=0.3),
    "sgd-nesterov-wd": functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    "adam": functools.partial(torch.optim.Adam, lr=0.01),
    "adam-wd": functools.partial(torch.optim.Adam, lr=0.01, betas=(0.8, 0.99), weight_decay=0.1, eps=1e-6),
    "adamw": functools.partial(torch.optim.AdamW, lr=0.01, weight_decay=0.1),
    "adamw-beta1-low": functools.partial(torch.optim.AdamW, lr=0.01, betas=(0.3, 0.9)),  # lerp's other branch
}


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("clip", [None, 0.5, "tensor"])
def test_matches_torch_optim_over_steps(name, backend, clip, gen):
    factory = OPTIMIZERS[name]
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]
    opt = factory(params)
    spec = OptimizerSpec.from_torch(factory)
    k = ops("cpu", force=backend)
    n = sum(p.numel() for p in params)
    buffers = [torch.cat([p.detach().reshape(-1) for p in params]), torch.full((n,), float("nan"))]
    state = init_state(spec, n)
    for step in range(1, 5):
        grads = [torch.randn(p.shape, generator=gen) for p in params]
        factor = None if clip is None else (torch.tensor(0.37) if clip == "tensor" else clip)
        for p, g in zip(params, grads):
            p.grad = g * (1.0 if factor is None else float(factor))
        opt.step()
        cur, nxt = buffers[(step - 1) % 2], buffers[step % 2]  # 2BW: ping-pong between two versions
        nxt.fill_(float("nan"))  # poisoned: every element of the new version must be written
        k.update(spec, step, torch.cat([g.reshape(-1) for g in grads]), cur, nxt, state, clip=factor)
        want = torch.cat([p.detach().reshape(-1) for p in params])
        torch.testing.assert_close(nxt, want, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{name} {backend} step {step}: {m}")
        for key, flat in state.items():
            torch.testing.assert_close(flat, torch.cat([opt.state[p][key].reshape(-1) for p in params]),
                                       rtol=1e-5, atol=1e-7, msg=lambda m: f"{name} state {key} step {step}: {m}")


def test_reference_is_torch_optim_bit_for_bit_in_fp32(gen):
    for name in ("sgd-nesterov-wd", "adam-wd", "adamw"):
        p = torch.nn.Parameter(torch.randn(1000, generator=gen))
        opt = OPTIMIZERS[name]([p])
        spec = OptimizerSpec.from_torch(opt)
        w, state = p.detach().clone(), init_state(spec, 1000)
        for step in range(1, 4):
            p.grad = torch.randn(1000, generator=gen)
            opt.step()
            update_reference(spec, step, p.grad, w, w, state)  # in place
            assert torch.equal(w, p.detach()), name


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("kind", ["sgd", "adam", "adamw"])
def test_low_precision_weights_fp32_state(n, dtype, kind, gen):
    spec = OptimizerSpec(kind, lr=0.01, momentum=0.9 if kind == "sgd" else 0.0, nesterov=kind == "sgd",
                         weight_decay=0.05)
    w = torch.randn(n, generator=gen).to(dtype)
    got_state = init_state(spec, n)
    for step in range(1, 4):
        # Each step starts both paths from the same inputs, so the tolerance is that of one step.
        want_state = {k: v.clone() for k, v in got_state.items()}
        g = torch.randn(n, generator=gen).to(dtype)
        got_out = torch.full((n,), float("nan"), dtype=dtype)  # poisoned
        want_out = torch.empty(n, dtype=dtype)
        update(spec, step, g, w, got_out, got_state, clip=0.9)
        update_reference(spec, step, g, w, want_out, want_state, clip=0.9)
        assert torch.isfinite(got_out).all(), "element(s) of the new version left unwritten"
        rtol, atol = TOL[dtype]
        torch.testing.assert_close(got_out, want_out, rtol=rtol, atol=atol)
        for key in spec.state_names:
            assert got_state[key].dtype == torch.float32
            # atol: fp32 rounding of O(1) terms that cancel (torch may fuse a*x+y into one FMA)
            torch.testing.assert_close(got_state[key], want_state[key], rtol=1e-5, atol=1e-6)
        w = got_out


def test_in_place_equals_out_of_place(gen):
    spec = OptimizerSpec("adamw", lr=0.01, weight_decay=0.1)
    w = torch.randn(4097, generator=gen)
    g = torch.randn(4097, generator=gen)
    out = torch.empty_like(w)
    s1, s2 = init_state(spec, 4097), init_state(spec, 4097)
    update(spec, 1, g, w, out, s1, block=1024)
    update(spec, 1, g, w, w, s2, block=1024)
    assert torch.equal(out, w)


def test_errors_say_expected_and_found():
    spec = OptimizerSpec("adam")
    g, w = torch.zeros(10), torch.zeros(10)
    state = init_state(spec, 10)
    for fn in (update, update_reference):
        with pytest.raises(KernelError, match=r"state\['exp_avg'\] dtype in \(float32\), found bfloat16"):
            fn(spec, 1, g, w, w, {"exp_avg": torch.zeros(10, dtype=torch.bfloat16), "exp_avg_sq": torch.zeros(10)})
        with pytest.raises(KernelError, match="missing \\['exp_avg_sq'\\].*init_state"):
            fn(spec, 1, g, w, w, {"exp_avg": torch.zeros(10)})
        with pytest.raises(KernelError, match="step to be a python int >= 1.*found 0"):
            fn(spec, 0, g, w, w, state)
        with pytest.raises(KernelError, match="out .* weights' dtype"):
            fn(spec, 1, g, w, torch.zeros(10, dtype=torch.bfloat16), state)
        buf = torch.zeros(20)
        with pytest.raises(KernelError, match="partially overlap"):
            fn(spec, 1, g, buf[:10], buf[5:15], state)
        with pytest.raises(KernelError, match="clip on cpu|clip to be a 0-d tensor"):
            fn(spec, 1, g, w, w, state, clip=torch.ones(3))
        out = torch.zeros(10)  # the gradient read while the new weights are written: even the same buffer
        with pytest.raises(KernelError, match="grad and out overlap in memory.*pass separate buffers"):
            fn(spec, 1, out, w, out, state)
        master = torch.zeros(10)
        with pytest.raises(KernelError, match="grad and copy overlap in memory"):  # a 16-bit copy inside the gradient
            fn(spec, 1, g, master, master, state, copy=g.view(torch.bfloat16)[:10])


def test_spec_from_torch_rejects_what_it_cannot_do():
    with pytest.raises(KernelError, match=r"amsgrad=True\) is not implemented"):
        OptimizerSpec.from_torch(functools.partial(torch.optim.Adam, amsgrad=True))
    with pytest.raises(KernelError, match="maximize=True"):
        OptimizerSpec.from_torch(functools.partial(torch.optim.SGD, lr=0.1, maximize=True))
    with pytest.raises(KernelError, match="expected torch.optim.SGD, Adam or AdamW, found RMSprop"):
        OptimizerSpec.from_torch(torch.optim.RMSprop)
    with pytest.raises(KernelError, match="nesterov needs momentum > 0"):
        OptimizerSpec("sgd", nesterov=True)
    assert OptimizerSpec.from_torch(functools.partial(torch.optim.Adam, decoupled_weight_decay=True)).kind == "adamw"
    assert OptimizerSpec.from_torch(torch.optim.AdamW).weight_decay == 0.01
    p = torch.nn.Parameter(torch.zeros(2))
    q = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(KernelError, match="param group 1 differing"):
        OptimizerSpec.from_torch(torch.optim.SGD([{"params": [p]}, {"params": [q], "lr": 0.5}], lr=0.1))
    # groups of named parameters (torch keeps their names in the group) with one set of hyper-parameters
    named = torch.optim.AdamW([{"params": [("p", p)]}, {"params": [("q", q)]}], lr=0.1)
    assert OptimizerSpec.from_torch(named).lr == 0.1
    with pytest.raises(KernelError, match=r"expected betas to be a pair \(beta1, beta2\), found 0.9"):
        OptimizerSpec("adam", betas=0.9)
    # tensor betas (torch allows them) become python floats: the kernels take scalars by value
    assert OptimizerSpec("adam", betas=(torch.tensor(0.5), torch.tensor(0.25))).betas == (0.5, 0.25)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_mixed_precision_copy_is_the_new_master_rounded(kind, dtype, gen):
    # Mixed precision: the fp32 master is stepped in place and its 16-bit compute copy written in
    # the same pass; the Triton kernel and the reference agree on both, and the copy is exactly
    # the master rounded to nearest-even (torch's .to()).
    factory = OPTIMIZERS["adamw"] if kind == "adamw" else OPTIMIZERS["sgd-momentum-dampening"]
    spec = OptimizerSpec.from_torch(factory)
    n = 1000
    grad, master = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    out = {}
    for backend in ("torch", "triton"):
        w, state = master.clone(), init_state(spec, n)
        copy = torch.full((n,), float("nan"), dtype=dtype)
        for step in (1, 2):
            ops("cpu", force=backend).update(spec, step, grad, w, w, state, clip=0.5, copy=copy)
        out[backend] = (w, copy, state)
    (w, copy, state), (tw, tcopy, tstate) = out["torch"], out["triton"]
    rtol, atol = TOL[torch.float32]
    torch.testing.assert_close(tw, w, rtol=rtol, atol=atol)
    assert torch.equal(copy, w.to(dtype)) and torch.equal(tcopy, tw.to(dtype))
    for k in state:
        torch.testing.assert_close(tstate[k], state[k], rtol=rtol, atol=atol)


def test_mixed_precision_copy_errors_say_expected_and_found():
    spec = OptimizerSpec.from_torch(OPTIMIZERS["adamw"])
    w = torch.zeros(8, dtype=torch.bfloat16)
    with pytest.raises(KernelError, match=r"a low-precision copy is written from float32 master weights; found out "
                                          r"torch.bfloat16"):
        update_reference(spec, 1, torch.zeros(8), w, w, init_state(spec, 8), copy=torch.zeros(8, dtype=torch.float16))
    with pytest.raises(KernelError, match=r"copy"):
        update_reference(spec, 1, torch.zeros(8), torch.zeros(8), torch.zeros(8), init_state(spec, 8),
                         copy=torch.zeros(8))
