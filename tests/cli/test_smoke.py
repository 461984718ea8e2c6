import json

from fastppl.cli import main


def test_eval_tiny_model_end_to_end(tmp_path, tokenizer_dir):
    text = tmp_path / "t.txt"
    text.write_text("To be, or not to be, that is the question.\n" * 20)
    out = tmp_path / "r.json"
    rc = main(["eval", "--model", "random:gpt2-tiny", "--tokenizer", str(tokenizer_dir), "--data", str(text),
               "--ctx", "64", "--device", "cpu", "--json", str(out), "--quiet"])
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["tokens_scored"] == result["tokens_total"] > 100
    assert 9.0 < result["nll"] < 12.0   # a random model is close to uniform over 50,257 ids (ln = 10.8)
