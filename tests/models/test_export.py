"""The linear decoder's step with its state as explicit tensors: torch.export and torch.compile(fullgraph=True)."""

import pytest
import torch
from helpers import causal_lm, random_ids

from hf_linear_attn.modeling_gpt2_style import DecoderStateStep


def prefill_then_step(variant="linear-elu", batch=2, n=10):
    model = causal_lm(variant)
    step = DecoderStateStep(model).eval()
    ids = random_ids(batch, n + 1)
    positions = torch.arange(n + 1).expand(batch, n + 1)
    with torch.no_grad():
        logits, *state = step(ids[:, :n], positions[:, :n], *step.initial_state(batch))
    return model, step, ids, positions, state


def test_the_explicit_state_step_equals_the_cached_forward():
    model, step, ids, positions, state = prefill_then_step()
    with torch.no_grad():
        logits = step(ids[:, 10:], positions[:, 10:], *state)[0]
    torch.testing.assert_close(logits[:, -1], model(ids).logits[:, -1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", ["linear-elu", "linear-favor", "linear-hedgehog"])
def test_torch_export_of_the_step_with_a_dynamic_batch_equals_eager(variant):
    model, step, ids, positions, state = prefill_then_step(variant)
    batch = torch.export.Dim("batch", min=1, max=64)
    exported = torch.export.export(
        step, (ids[:, 10:], positions[:, 10:], *state),
        dynamic_shapes=({0: batch}, {0: batch}, tuple({0: batch} for _ in state)),
    ).module()
    with torch.no_grad():
        for rows in (slice(0, 2), slice(1, 2)):  # the traced batch and another one
            args = (ids[rows, 10:], positions[rows, 10:], *(t[rows] for t in state))
            for got, want in zip(exported(*args), step(*args)):
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_the_step_compiles_as_one_graph_and_equals_eager():
    model, step, ids, positions, state = prefill_then_step()
    explanation = torch._dynamo.explain(step)(ids[:, 10:], positions[:, 10:], *state)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    compiled = torch.compile(step, fullgraph=True)
    with torch.no_grad():
        for got, want in zip(compiled(ids[:, 10:], positions[:, 10:], *state), step(ids[:, 10:], positions[:, 10:], *state)):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_the_cached_forward_has_no_graph_break_from_position_checks():
    """The old forward read int(position_ids.max()) on every call: a graph break (and a host sync) per forward."""
    model = causal_lm("linear-elu")
    ids = random_ids(2, 12)
    explanation = torch._dynamo.explain(model)(ids, use_cache=False)
    assert explanation.graph_break_count == 0
