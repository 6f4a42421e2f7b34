"""Message compression round trips and error-feedback bookkeeping."""

import pytest
import torch
from safetensors.torch import load, save

from training.exchange.compression import Codec, ErrorFeedback, decode_field


def sample(n=1000, seed=0):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * torch.linspace(0.01, 3, n)


def test_uncompressed_is_bit_exact():
    v = sample()
    assert torch.equal(decode_field("delta", Codec("none").encode("delta", v)), v)


@pytest.mark.parametrize("scheme,levels,bytes_per_value", [("int8", 127, 1), ("int4", 7, 0.5)])
@pytest.mark.parametrize("n", [1000, 1001, 3])
def test_quantised_round_trip_is_within_half_a_step_of_each_chunk(scheme, levels, bytes_per_value, n):
    codec = Codec(scheme, scale_chunk=64)
    v = sample(n)
    payload = load(save(codec.encode("delta", v)))  # through the wire format
    decoded = decode_field("delta", payload)
    chunks = -(-n // 64)
    scale = torch.nn.functional.pad(v.abs(), (0, chunks * 64 - n)).view(chunks, 64).amax(1) / levels
    step = scale.repeat_interleave(64)[:n]
    assert decoded.shape == v.shape
    assert torch.all((decoded - v).abs() <= step / 2 + 1e-6)
    assert torch.allclose(decoded.abs().max(), v.abs().max())  # the largest value of a chunk is exact
    value_bytes = sum(t.numel() for k, t in payload.items() if k.endswith((".q8", ".q4")))  # one-byte dtypes
    assert value_bytes == -(-n * 2 * bytes_per_value // 2)
    assert payload["delta.scale"].numel() == chunks


def test_int4_packs_two_values_per_byte_low_nibble_first():
    payload = Codec("int4", scale_chunk=2).encode("x", torch.tensor([7.0, -7.0, 1.0, 0.25]))
    assert payload["x.q4"].dtype == torch.uint8
    # Values in [-7, 7] are stored biased by 8: first chunk 7 -> 15, -7 -> 1; second chunk (scale 1/7)
    # 1.0 -> 7 -> 15, 0.25 -> 1.75 -> 2 -> 10.
    assert payload["x.q4"].tolist() == [15 | 1 << 4, 15 | 10 << 4]


def test_zero_chunks_decode_to_zero():
    v = torch.zeros(300)
    v[:10] = 1.0
    decoded = decode_field("d", Codec("int8", scale_chunk=64).encode("d", v))
    assert torch.equal(decoded, v)


def test_topk_keeps_the_largest_values_and_their_positions():
    v = sample(500)
    payload = Codec("none", topk=0.1).encode("delta", v)
    decoded = decode_field("delta", payload)
    kept = v.abs().topk(50).indices
    assert torch.equal(decoded[kept], v[kept])
    assert int((decoded != 0).sum()) == 50
    assert payload["delta.index"].dtype == torch.int32


def test_topk_with_int8_quantises_only_the_kept_values():
    v = sample(500)
    decoded = decode_field("delta", Codec("int8", topk=0.2).encode("delta", v))
    assert int((decoded != 0).sum()) <= 100
    assert torch.allclose(decoded.abs().max(), v.abs().max())


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="scheme"):
        Codec("int2")
    with pytest.raises(ValueError, match="topk"):
        Codec("int8", topk=0)


def test_error_feedback_keeps_what_was_dropped_and_loses_nothing_over_time():
    codec = Codec("int4", scale_chunk=32)
    feedback = ErrorFeedback(codec, 200, ("delta",))
    index = torch.arange(50, 150)
    sent_total, true_total = torch.zeros(100), torch.zeros(100)
    for step in range(20):
        delta = sample(100, seed=step)
        before = feedback.residual["delta"].clone()
        payload, decoded, residual = feedback.encode({"delta": delta}, index)
        assert torch.equal(feedback.residual["delta"], before)  # encode alone changes nothing
        assert torch.allclose(residual["delta"], delta + before[index] - decoded["delta"])
        feedback.commit(index, residual)
        assert torch.equal(feedback.residual["delta"][index], residual["delta"])
        sent_total += decode_field("delta", payload)
        true_total += delta
    # Everything sent plus what is still held back is everything there was to send.
    assert torch.allclose(sent_total + feedback.residual["delta"][index], true_total, atol=1e-4)
    assert torch.count_nonzero(feedback.residual["delta"][:50]) == 0  # other fragments untouched
    # Without feedback the dropped part is simply lost.
    plain = ErrorFeedback(codec, 200, ("delta",), enabled=False)
    assert plain.residual == {}


def test_error_feedback_after_a_message_an_earlier_life_sent():
    feedback = ErrorFeedback(Codec("int8"), 10, ("delta",))
    feedback.residual["delta"] += 0.5
    index = torch.arange(10)
    sent = {"delta": torch.ones(10)}
    residual = feedback.residual_after({"delta": torch.full((10,), 2.0)}, index, sent)
    assert torch.allclose(residual["delta"], torch.full((10,), 1.5))


def test_residual_checkpoints_and_restores():
    feedback = ErrorFeedback(Codec("int8"), 10, ("anchor", "delta"))
    feedback.residual["delta"] += 3.0
    tensors = feedback.state_tensors()
    assert set(tensors) == {"residual.anchor", "residual.delta"}
    restored = ErrorFeedback(Codec("int8"), 10, ("anchor", "delta"))
    restored.load_state_tensors(load(save(tensors)))
    assert torch.equal(restored.residual["delta"], feedback.residual["delta"])
    restored.reset()
    assert torch.count_nonzero(restored.residual["delta"]) == 0
