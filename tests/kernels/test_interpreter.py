"""The interpreter must be on before the kernels are decorated; the seam must refuse otherwise."""
import os
import subprocess
import sys

import pytest
import torch

from fxpipe.kernels import KernelBackendError, backend, ops


def test_interpret_env_was_set_before_kernels_were_imported():
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from fxpipe.kernels import accumulate, adama, update
    from fxpipe.kernels._jit import is_interpreted

    for kernel in (accumulate._accumulate_kernel, update._update_kernel,
                   adama._adama_accumulate_kernel, adama._adama_update_kernel):
        assert is_interpreted(kernel), (
            f"{kernel} was decorated for a GPU: something imported fxpipe.kernels' Triton modules "
            f"before tests/kernels/conftest.py set TRITON_INTERPRET=1")


def test_backend_defaults_and_force():
    assert backend("cpu") == "torch"
    assert backend(torch.device("cuda", 0)) == "triton"
    assert backend("cpu", force="triton") == "triton"
    assert backend("cuda", force="torch") == "torch"
    assert ops("cpu").name == "torch"
    assert ops("cpu", force="triton").name == "triton"
    with pytest.raises(KernelBackendError, match="expected force in"):
        backend("cpu", force="cuda")


def test_forcing_triton_without_interpreter_says_what_to_do():
    code = ("import os; os.environ.pop('TRITON_INTERPRET', None)\n"
            "from fxpipe.kernels import backend, KernelBackendError\n"
            "try:\n    backend('cpu', force='triton')\nexcept KernelBackendError as e:\n    print('ERR', e)\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert "ERR" in out.stdout, out.stdout + out.stderr
    assert "Set TRITON_INTERPRET=1" in out.stdout and "before" in out.stdout


@pytest.mark.parametrize("force", ["torch", "triton"])
def test_each_forced_path_runs_a_step(force, gen):
    from fxpipe.kernels import OptimizerSpec, init_state

    k = ops("cpu", force=force)
    n = 777
    acc = torch.empty(n)
    grads = [torch.randn(n, generator=gen) for _ in range(3)]
    for i, g in enumerate(grads):
        k.accumulate(acc, g, 1 / 3, overwrite=i == 0)
    torch.testing.assert_close(acc, sum(g / 3 for g in grads), rtol=1e-6, atol=1e-6)
    spec = OptimizerSpec("adamw", lr=0.1, weight_decay=0.1)
    state = init_state(spec, n)
    w = torch.randn(n, generator=gen)
    out = torch.full((n,), float("nan"))
    k.update(spec, 1, acc, w, out, state)
    assert torch.isfinite(out).all() and not torch.equal(out, w)
