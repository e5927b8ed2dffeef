"""Models built on the meta device, on 4 gloo ranks in one process group: each rank materialises
only its own stage (from a state dict, a torch.save file, or the modules' initialisers), trains
bitwise as the fully built model does in the same layout, and holds only its stage's parameter
bytes; a wrong state dict fails on every rank, none left waiting."""

import os

import pytest
import torch

from tests.dist.harness import run_function

pytestmark = [pytest.mark.dist, pytest.mark.timeout(400)]

STEPS = 3


def _model(name, meta):
    from tests.models import gpt2_tiny, llama_tiny

    factory = {"gpt2": gpt2_tiny, "llama": llama_tiny}[name]
    if not meta:
        return factory(labels=True)
    with torch.device("meta"):
        model, example = factory(labels=True)
    return model, {k: v.to("meta") for k, v in example.items()}


def _batches(example, m, w):
    g = torch.Generator().manual_seed(1)
    b, seq = example["input_ids"].shape
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, 100, (b * m * w, seq), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def _storages(tensors):
    """Bytes of the distinct real (non-meta) storages behind ``tensors``."""
    seen = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and not t.is_meta:
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def held_bytes(pipe, model):
    """Parameter and buffer bytes this rank holds: the model's tensors and every stage's flat
    buffers and module buffers (the stages other ranks run are on the meta device)."""
    tensors = [*model.parameters(), *model.buffers(), *pipe.staged.unused_state.values()]
    for st in pipe.staged.stages:
        tensors += [*st.flat.buffers.values(), *st.module.buffers()]
    return _storages(tensors)


def stage_bytes(pipe):
    """The bytes of this rank's own stage: its flat buffers and its module buffers."""
    (wk,) = pipe.workers.values()
    st = pipe.staged.stages[wk.index]
    return _storages([*st.flat.buffers.values(), *st.module.buffers()])


def _train(name, meta, stages, schedule, weights, tmp):
    import functools

    import fxpipe

    model, example = _model(name, meta)
    pipe = fxpipe.compile(model, example, microbatches=4, stages=stages, schedule=schedule, weights=weights,
                          optimizer=functools.partial(torch.optim.AdamW, lr=1e-2), verbose=False)
    held, own = held_bytes(pipe, model), stage_bytes(pipe)
    initial = pipe.state_dict()
    losses = [float(pipe.step(x)) for x in _batches(example, 4, 4 // stages)]
    return {"losses": losses, "state": pipe.state_dict(), "initial": initial, "held": held, "own": own,
            "model_bytes": _storages([*_model(name, False)[0].state_dict().values()])}


def meta_cases(rank, world):
    import torch.distributed as dist

    import fxpipe

    tmp = os.environ.get("FXPIPE_TEST_TMP", "/tmp")
    out = {}
    # the reference: the same model, fully built, trained in the same layout
    out["gpt2_full"] = _train("gpt2", False, 4, "2bw", None, tmp)
    full, _ = _model("gpt2", False)
    out["gpt2_meta_dict"] = _train("gpt2", True, 4, "2bw", full.state_dict(), tmp)
    # a torch.save file; Llama's rotary inv_freq is a non-persistent buffer: the initialiser makes it
    llama, _ = _model("llama", False)
    path = os.path.join(tmp, "llama.pt")
    if rank == 0:
        torch.save(llama.state_dict(), path)
    dist.barrier()
    out["llama_full"] = _train("llama", False, 2, "1f1b", None, tmp)
    out["llama_meta_file"] = _train("llama", True, 2, "1f1b", path, tmp)
    # no weights: the modules' initialisers, seeded per module (compared with one process's in the parent)
    model, example = _model("gpt2", True)
    pipe = fxpipe.compile(model, example, microbatches=4, stages=4, verbose=False)
    out["gpt2_init"] = {"initial": pipe.state_dict(), "held": held_bytes(pipe, model), "own": stage_bytes(pipe)}
    # a state dict lacking a key: every rank raises before the plan's broadcast, none waits
    bad = {k: v for k, v in full.state_dict().items() if k != "transformer.h.1.mlp.c_fc.weight"}
    model, example = _model("gpt2", True)
    try:
        fxpipe.compile(model, example, microbatches=4, stages=4, weights=bad, verbose=False)
        out["missing_key"] = None
    except fxpipe.errors.ConfigError as e:
        out["missing_key"] = str(e)
    dist.barrier()  # every rank got here: nobody is stuck in a collective
    return out


@pytest.mark.slow  # 4 ranks, each importing transformers and building 7 pipelines: ~80 s on 2 cores
def test_meta_models_build_only_their_stage_on_four_ranks(tmp_path):
    import fxpipe

    os.environ["FXPIPE_TEST_TMP"] = str(tmp_path)
    results = run_function(4, "tests.dist.test_meta_build_dist:meta_cases", timeout=360)
    errors = [f"rank {r}:\n{res['error']}" for r, res in enumerate(results) if res["error"]]
    assert not errors, "\n".join(errors)
    values = [res["value"] for res in results]
    for full, meta in (("gpt2_full", "gpt2_meta_dict"), ("llama_full", "llama_meta_file")):
        for r, v in enumerate(values):
            a, b = v[full], v[meta]
            assert a["losses"] == b["losses"], (meta, r, a["losses"], b["losses"])
            for key, t in a["state"].items():
                assert torch.equal(t, b["state"][key]), (meta, r, key)
            # a fully built model keeps the whole model on every rank; the meta one only its stage
            assert a["held"] >= a["model_bytes"], (full, r, a["held"], a["model_bytes"])
            assert b["held"] == b["own"] < b["model_bytes"], (meta, r, b["held"], b["own"], b["model_bytes"])
    # gpt2 on 4 stages: the four ranks' stages together hold the model (its tied wte copy twice)
    own = [v["gpt2_meta_dict"]["own"] for v in values]
    assert sum(own) >= values[0]["gpt2_meta_dict"]["model_bytes"]
    print("held bytes per rank (full build, meta build):",
          [(v["gpt2_full"]["held"], v["gpt2_meta_dict"]["held"]) for v in values])

    # without weights: every rank's stage is initialised as one process initialises the whole model
    model, example = _model("gpt2", True)
    single = fxpipe.compile(model, example, microbatches=4, stages=1, verbose=False).state_dict()
    for r, v in enumerate(values):
        assert v["gpt2_init"]["held"] == v["gpt2_init"]["own"]
        for key, t in single.items():
            assert torch.equal(t, v["gpt2_init"]["initial"][key]), (r, key)

    for r, v in enumerate(values):
        msg = v["missing_key"]
        assert msg is not None and "transformer.h.1.mlp.c_fc.weight" in msg and "missing 1 keys" in msg, (r, msg)
