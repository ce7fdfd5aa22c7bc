"""`python -m k3text.decode`: prompt sources, output records, and user errors."""

import json

import pytest

from k3text.decode import main

from helpers import MODELS


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    path = tmp_path_factory.mktemp("cfg") / "tiny.yml"
    path.write_text(f"model_config: {MODELS / 'k3-tiny.yml'}\n"
                    "tokenizer_type: byte\nvocab_size: 260\nbos_token_id: 256\n"
                    "eos_token_id: 257\npad_token_id: 258\nmax_decode_steps: 4\n"
                    "per_device_batch_size: 2\nprogress: false\n")
    return str(path)


def read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_prompt_ids_to_output_file(config, tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    assert main([config, "prompt_ids=1,2,3", f"output_file={out}", "return_log_prob=true",
                 "return_top_logprobs=3", "ignore_eos=true"]) == 0
    [record] = read(out)
    assert record["prompt_ids"] == [1, 2, 3]
    assert len(record["output_ids"]) == 4 == len(record["output_logprobs"])
    assert record["finish_reason"] == "length"
    assert all(lp <= 0 for lp in record["output_logprobs"])
    # Per token its 3 most likely [id, log-probability], most likely first: greedy's choice.
    top = record["output_top_logprobs"]
    assert [len(t) for t in top] == [3] * 4
    assert [t[0][0] for t in top] == record["output_ids"]
    assert [t[0][1] for t in top] == record["output_logprobs"]
    assert all(a[1] >= b[1] >= c[1] and len({a[0], b[0], c[0]}) == 3 for a, b, c in top)
    assert "decode" in capsys.readouterr().out


def test_prompts_file_keeps_input_order_across_batches(config, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    lines = [{"prompt": "hello"}, {"prompt_ids": [5, 6]}, {"prompt": "a longer prompt here"}]
    prompts.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    out = tmp_path / "out.jsonl"
    assert main([config, f"prompts_file={prompts}", f"output_file={out}"]) == 0
    records = read(out)
    assert not [r for r in records if "output_top_logprobs" in r]  # only when asked for
    assert [r.get("prompt") for r in records] == ["hello", None, "a longer prompt here"]
    assert records[1]["prompt_ids"] == [5, 6]
    assert records[0]["prompt_ids"][0] == 256  # bos prepended to text prompts
    assert all("output_text" in r and r["finish_reason"] in ("eos", "length") for r in records)


@pytest.mark.parametrize("content,message", [
    ('{"prompt": "ok"}\n{"prompt": \n', "prompts.jsonl:2: invalid JSON"),
    ('{"prompt_ids": [1, "x"]}\n', "prompts.jsonl:1: \"prompt_ids\" must be a non-empty list"),
    ('{"text": "no"}\n', "prompts.jsonl:1: each line must be an object with exactly one of"),
    ('{"prompt": "ok", "expected": 3}\n', "prompts.jsonl:1: \"expected\" must be a string"),
    ('{"prompt": "ok", "expect": "x"}\n', "prompts.jsonl:1: unknown field(s) 'expect'"),
    ('{"prompt": ""}\n', "prompts.jsonl:1: \"prompt\" is empty"),
])
def test_malformed_prompts_file_names_the_line(config, tmp_path, capsys, content, message):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(content)
    out = tmp_path / "out.jsonl"
    assert main([config, f"prompts_file={prompts}", f"output_file={out}"]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("args,message", [
    (["prompt_ids=1,2,3", "max_decode_steps=200"], "exceeds max_target_length=128"),
    (["prompt_ids=" + ",".join(["7"] * 65)], "more than max_prefill_predict_length=64"),
    (["prompt=hi", "tokenizer_type=none"], "prompt is text but tokenizer_type is 'none'"),
    (["prompt_ids=1,x"], "expected token ids separated by commas or spaces"),
    (["prompt_ids=1,999"], "outside [0, vocab_size=260)"),
])
def test_user_errors_exit_2_with_one_message(config, capsys, args, message):
    assert main([config, *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1] and err[-1].startswith("error: ")


def test_ids_separate_by_commas_or_spaces():
    from k3text.decode import parse_ids

    assert parse_ids("1,2,3", "x") == parse_ids("1 2 3", "x") == parse_ids(" 1, 2 ,3 ", "x") \
        == (1, 2, 3)


def test_prompts_are_checked_before_any_weight_loads(config, tmp_path, capsys, monkeypatch):
    from k3text import decode

    monkeypatch.setattr(decode, "build_engine", lambda cfg: pytest.fail("the weights were loaded"))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt_ids": [1, 2]}\n\n{"prompt_ids": [1, 999]}\n')
    assert main([config, f"prompts_file={prompts}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"error: {prompts}:3 has token ids outside"), err


def test_an_output_file_is_replaced_only_when_asked_and_never_the_prompts(config, tmp_path,
                                                                           capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt_ids": [1, 2]}\n')
    out = tmp_path / "out.jsonl"
    out.write_text("earlier results\n")
    assert main([config, f"prompts_file={prompts}", f"output_file={out}"]) == 2
    assert "already exists; set output_overwrite=true" in capsys.readouterr().err
    assert out.read_text() == "earlier results\n"
    assert main([config, f"prompts_file={prompts}", f"output_file={prompts}",
                 "output_overwrite=true"]) == 2
    assert "is the prompts_file" in capsys.readouterr().err
    assert prompts.read_text() == '{"prompt_ids": [1, 2]}\n'
    assert main([config, f"prompts_file={prompts}", f"output_file={out}",
                 "output_overwrite=true"]) == 0
    assert read(out)[0]["prompt_ids"] == [1, 2]


def test_each_prompt_samples_with_its_own_seed_whatever_its_batch(config, tmp_path):
    """Three copies of one prompt in batches of two, sampled: each gets seed + its index, so
    the third (alone in the second batch) is not the first again, and equals itself decoded
    alone with that seed."""
    from k3text import decode
    from k3text.config import load_config

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt_ids": [5, 6, 7]}\n' * 3)
    sampled = ["decode_sampling_strategy=weighted", "ignore_eos=true", "max_decode_steps=8"]
    records = decode.run(load_config(config, [f"prompts_file={prompts}", *sampled]))
    outputs = [r["output_ids"] for r in records]
    assert outputs[0] != outputs[2] and outputs[0] != outputs[1]
    alone = decode.run(load_config(config, ["prompt_ids=5,6,7", "seed=2",
                                            "per_device_batch_size=1", *sampled]))
    assert alone[0]["output_ids"] == outputs[2]


def test_tokenizer_defaults_to_the_one_shipped_with_the_checkpoint(tmp_path):
    from k3text.config import load_config
    from k3text.tokenizer import tokenizer_file

    (tmp_path / "tiktoken.model").write_text("")
    cfg = load_config(MODELS / "k3-tiny.yml", [f"load_parameters_path={tmp_path}",
                                                "tokenizer_type=tiktoken"])
    assert tokenizer_file(cfg) == str(tmp_path / "tiktoken.model")
    assert tokenizer_file(cfg.replace(tokenizer_path="x.model")) == "x.model"
