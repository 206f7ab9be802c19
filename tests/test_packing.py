"""Item: packing. Whole documents plus EOS are concatenated, then cut into rows (nothing is dropped); positions
restart and attention stays within each document, so a packed row computes what its documents compute alone."""

import json
from pathlib import Path

import torch

from astrai.config import load_config
from astrai.data.examples import IGNORE_INDEX, collate_lm, pack_examples
from astrai.distributed import setup_distributed
from astrai.models import AutoRegressiveLM, load_pretrained, tiny_config, tiny_tokenizer

REPO = Path(__file__).resolve().parents[1]


def test_seq_packing_keeps_every_token_and_every_eos(tiny_model_dir, tmp_path):
    from astrai.trainer.learners.seq import build_seq

    tok = tiny_tokenizer()
    texts = [" ".join(f"w{i}" for i in range(45)), "a short one", "seventeen tokens or so"]
    lengths = [len(tok.encode(t)) + 1 for t in texts]
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    config = load_config(str(REPO / "configs/examples/seq.yaml"),
                         ["--model.path", str(tiny_model_dir), "--data.path", str(data), "--data.max_length", "32",
                          "--data.packing", "true"])
    policy, tokenizer = load_pretrained(tiny_model_dir)
    rows = build_seq(config, setup_distributed("cpu"), policy, tokenizer).data_sampler.dataset
    stream = [t for ids, _, _ in rows for t in ids]
    assert len(stream) == sum(lengths) > 100 and all(len(ids) <= 32 for ids, _, _ in rows)
    assert stream == [t for text in texts for t in tok.encode(text) + [tok.eos_token_id]]
    ends = [i for i, t in enumerate(stream) if t == tok.eos_token_id]
    assert ends == [sum(lengths[:k + 1]) - 1 for k in range(3)]  # each document keeps its EOS separator


def test_packed_row_logits_equal_each_document_alone():
    torch.manual_seed(0)
    model = AutoRegressiveLM(tiny_config()).eval()
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(3, 280, (n,), generator=g).tolist() for n in (5, 9, 7, 12)]
    rows = pack_examples([(d, d) for d in docs], max_length=20)  # 33 tokens: the third document spans both rows
    assert [r[2] for r in rows] == [[0] * 5 + [1] * 9 + [2] * 6, [0] + [1] * 12]
    assert [r[1][0] for r in rows] == [IGNORE_INDEX, IGNORE_INDEX] and rows[0][1][5] == IGNORE_INDEX
    batch = collate_lm(rows, pad_token_id=2)
    with torch.no_grad():
        packed = model(batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids,
                       document_ids=batch.document_ids)
        pieces = [(0, 0, docs[0]), (0, 5, docs[1]), (0, 14, docs[2][:6]), (1, 0, docs[2][6:]), (1, 1, docs[3])]
        for row, start, ids in pieces:
            alone = model(torch.tensor([ids]))[0]
            torch.testing.assert_close(packed[row, start:start + len(ids)], alone, rtol=1e-5, atol=1e-5)


def test_check_line_counts_packed_rows_as_rows(tiny_model_dir, tmp_path, capsys):
    from astrai.train import main

    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": " ".join(f"w{i}" for i in range(40))}) + "\n" for _ in range(3)))
    base = ["--config", str(REPO / "configs/examples/seq.yaml"), "--model.path", str(tiny_model_dir), "--data.path",
            str(data), "--data.max_length", "32", "--train.output_dir", str(tmp_path / "o"), "--check"]
    assert main(base + ["--data.packing", "true"]) == 0
    packed = capsys.readouterr().out
    assert main(base + ["--data.packing", "false", "--data.truncation", "left"]) == 0
    cut = capsys.readouterr().out
    tokens = 3 * (len(tiny_tokenizer().encode(" ".join(f"w{i}" for i in range(40)))) + 1)  # with each EOS
    rows = -(-tokens // 32)  # the documents run on across rows: nothing is dropped
    assert f"; {rows} packed rows of up to 32 tokens (data.packing) from {data};" in packed, packed
    assert f"; 3 training examples from {data};" in cut, cut
