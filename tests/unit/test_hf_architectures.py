"""Hugging Face architectures beyond the training cases', each trained by a zb pipeline of two
stages (the planner's cut) in one process against the float64 reference
(``tests/reference.train_flush``): zb has 1f1b's numbers and also splits every backward, so one
run covers the capture, the cut, the stage code and both kinds of backward."""

import copy
import functools

import pytest
import torch

import fxpipe
from tests.models import HF_ARCHITECTURES, hf_architecture
from tests.reference import train_flush

pytest.importorskip("transformers")


@pytest.mark.parametrize("name", sorted(HF_ARCHITECTURES))
def test_a_hugging_face_architecture_trains_as_eager_does(name):
    m, b = 4, 2
    model, example = hf_architecture(name, batch=b)
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(3):
        ids = torch.randint(2, 100, (m * b, 8), generator=g)
        batches.append({"input_ids": ids, "labels": ids.clone()})
    reference = copy.deepcopy(model).double()
    if name == "mixtral":  # transformers' grouped expert matmul refuses float64: its batched one does not
        reference.config._experts_implementation = "batched_mm"
    opt = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
    ref_losses, ref = train_flush(reference, [(x, None) for x in batches], m, None, opt)

    pipe = fxpipe.compile(model, example, optimizer=opt, microbatches=m, schedule="zb", stages=2, verbose=False)
    losses = [pipe.step(x) for x in batches]
    pipe.flush()
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    sd = pipe.state_dict()
    for key, p in ref.named_parameters():
        assert torch.allclose(sd[key].double(), p, rtol=0, atol=2e-5), (key, (sd[key].double() - p).abs().max())
    assert len(pipe.plan.stage_plans) == 2
