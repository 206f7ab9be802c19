"""Padding-free scoring: a batch's real tokens packed into one row (`Sequences.packed`), each sequence attending only
within itself (`SegmentedCausalAttention`), give the padded batch's log-probs, entropies, values and gradients at
every real response token, 0 at padding; a hand case pins the packed layout."""

import pytest
import torch

from astrai.data.sequences import Sequences
from astrai.models import AutoRegressiveLM, ValueModel, tiny_config
from astrai.models.attention import SegmentedCausalAttention
from astrai.forward import response_logprobs, response_values, supports_packing

EOS = 2
PROMPTS = [[3], [4, 5, 6], [7, 8], [9, 10, 11, 12], [13, 14]]
RESPONSES = [[3, 4], [5, 6, 7, 8, 2], [9], [10, 11, 2], [12, 13, 14, 15]]


def batch() -> Sequences:
    return Sequences.from_tokens(PROMPTS, RESPONSES, pad_token_id=EOS)


def model(seed=0) -> AutoRegressiveLM:
    torch.manual_seed(seed)
    return AutoRegressiveLM(tiny_config())


def test_packed_layout_hand_case():
    seqs = Sequences.from_tokens(PROMPTS[:3], RESPONSES[:3], pad_token_id=EOS)  # P = 3, T = 5
    packed = seqs.packed()
    assert packed.seq_lengths == (3, 8, 3)
    assert packed.input_ids.tolist() == [[3, 3, 4, 4, 5, 6, 5, 6, 7, 8, 2, 7, 8, 9]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2]]
    # row 0: prompt token 3 scores response 3, response 3 scores 4; row 1: 6 scores 5 ... 8 scores 2; row 2: 8 -> 9
    scorers = [0, 1, 5, 6, 7, 8, 9, 12]
    assert packed.score_at[0].nonzero().squeeze(-1).tolist() == scorers
    assert packed.labels.tolist() == [3, 4, 5, 6, 7, 8, 2, 9]
    out = packed.unpack(torch.arange(1.0, 9.0))
    assert out.tolist() == [[1, 2, 0, 0, 0], [3, 4, 5, 6, 7], [8, 0, 0, 0, 0]]


def test_packed_refuses_a_response_after_padding():
    seqs = batch()
    holes = seqs.attention_mask.clone()
    holes[1, seqs.prompt_length + 1] = False  # row 1's second response token becomes padding, its third stays real
    broken = Sequences(input_ids=seqs.input_ids, attention_mask=holes, position_ids=seqs.position_ids,
                       prompt_length=seqs.prompt_length, action_mask=seqs.action_mask)
    with pytest.raises(ValueError, match="follows a padding column"):
        broken.packed()


def test_segmented_attention_equals_a_block_diagonal_causal_mask():
    g = torch.Generator().manual_seed(0)
    lengths = [3, 1, 5]
    q = torch.randn(1, 9, 4, 8, generator=g)
    k, v = torch.randn(1, 9, 2, 8, generator=g), torch.randn(1, 9, 2, 8, generator=g)
    doc = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))
    allowed = (doc[:, None] == doc[None, :]) & torch.ones(9, 9, dtype=torch.bool).tril()
    kk, vv = k.repeat_interleave(2, dim=2), v.repeat_interleave(2, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, kk) / 8 ** 0.5
    reference = torch.einsum("bhqk,bkhd->bqhd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), vv)
    torch.testing.assert_close(SegmentedCausalAttention(lengths)(0, q, k, v), reference)


@pytest.mark.parametrize("with_entropy", [False, True])
def test_packed_logprobs_and_gradients_equal_the_padded_batch(with_entropy):
    seqs, temperature = batch(), 0.7
    mask = seqs.action_mask
    packed_model, padded_model = model(), model()
    lp, ent = response_logprobs(packed_model, seqs, temperature=temperature, with_entropy=with_entropy)
    ref_lp, ref_ent = response_logprobs(padded_model, seqs, temperature=temperature, with_entropy=with_entropy,
                                        packed=False)
    assert lp.shape == mask.shape and torch.all(lp[~mask] == 0)
    torch.testing.assert_close(lp[mask], ref_lp[mask])
    weights = torch.linspace(0.5, 1.5, mask.numel()).view(mask.shape)
    loss, ref_loss = (lp * weights * mask).sum(), (ref_lp * weights * mask).sum()
    if with_entropy:
        assert torch.all(ent[~mask] == 0)
        torch.testing.assert_close(ent[mask], ref_ent[mask])
        loss, ref_loss = loss + ent[mask].sum(), ref_loss + ref_ent[mask].sum()
    loss.backward()
    ref_loss.backward()
    for (name, p), q in zip(packed_model.named_parameters(), padded_model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_packed_no_grad_scoring_equals_the_padded_batch():
    seqs, m = batch(), model().eval()
    with torch.no_grad():
        lp, _ = response_logprobs(m, seqs, temperature=1.0)
        ref_lp, _ = response_logprobs(m, seqs, temperature=1.0, packed=False)
    torch.testing.assert_close(lp, ref_lp)  # both 0 at padding on the no-grad path


def test_packed_values_and_gradients_equal_the_padded_batch():
    seqs = batch()
    mask = seqs.action_mask
    critics = [ValueModel.from_policy(model()) for _ in range(2)]
    torch.nn.init.normal_(critics[0].value_head.weight, std=0.1)
    critics[1].load_state_dict(critics[0].state_dict())
    values = response_values(critics[0], seqs)
    reference = response_values(critics[1], seqs, packed=False)
    assert torch.all(values[~mask] == 0)
    torch.testing.assert_close(values[mask], reference[mask])
    ((values - 1) ** 2 * mask).sum().backward()
    ((reference - 1) ** 2 * mask).sum().backward()
    for (name, p), q in zip(critics[0].named_parameters(), critics[1].parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_packing_is_used_through_wrappers_only_for_astrai_models():
    assert supports_packing(torch.nn.DataParallel(model())) and supports_packing(ValueModel.from_policy(model()))
    assert not supports_packing(torch.nn.Linear(2, 2))


def test_trunk_refuses_seq_lengths_that_do_not_fit():
    m = model()
    with pytest.raises(ValueError, match="seq_lengths needs one packed row"):
        m(torch.ones(2, 4, dtype=torch.long), seq_lengths=[4, 4])
    with pytest.raises(ValueError, match="seq_lengths needs one packed row"):
        m(torch.ones(1, 4, dtype=torch.long), seq_lengths=[2, 1])
    with pytest.raises(ValueError, match="seq_lengths takes no attention_mask"):
        m(torch.ones(1, 4, dtype=torch.long), attention_mask=torch.ones(1, 4), seq_lengths=[4])
