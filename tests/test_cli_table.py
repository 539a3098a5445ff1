"""`drama3 table`: the paper's per-frame table (docs/speaking.md, the command line)."""

import json

from model_helpers import tiny_config_dict

from transformers_drama3.cli import main


def test_table_prints_the_full_size_figures(capsys):
    assert main(["table"]) == 0
    out = capsys.readouterr().out
    assert "35.90 B" in out and "5.95 GB" in out
    assert "layers whose KV cache grows with context" in out


def test_table_accounts_a_given_config(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(tiny_config_dict()))
    assert main(["table", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    # tiny: 4 backbone layers with 1 full-attention layer, tower of 2 shared + 3 codebook layers
    rows = {line[:44].strip(): line[44:].split() for line in out.splitlines()[1:]}
    assert rows["sequential layers after the backbone"][0] == "5"
    assert rows["layers whose KV cache grows with context"][0] == "6"


def test_table_with_a_missing_config_says_so(tmp_path, capsys):
    assert main(["table", "--config", str(tmp_path / "nope.json")]) == 2
    assert "no such file" in capsys.readouterr().err
