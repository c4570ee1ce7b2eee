"""verl's parquet data (spmdsplit/data/parquet.py, spmdsplit/data/sources.py, the prompt-length rules
in spmdsplit/data/prompts.py) and the GSM8K writer (tools/data/make_gsm8k_parquet.py)."""

import importlib.util
import json
import os
import re
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from omegaconf import OmegaConf

from spmdsplit.config import DataConfig
from spmdsplit.data.parquet import DataError, read_parquet_rows, render_prompt
from spmdsplit.data.prompts import PromptDataset, collate_prompts, filter_overlong_prompts, prompt_lengths
from spmdsplit.data.sources import SYNTHETIC_VAL_SAMPLES, build_rows, format_report
from spmdsplit.embedded import ensure_embedded_model
from spmdsplit.models import load_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tools", "data", "make_gsm8k_parquet.py")
SAMPLE = os.path.join(ROOT, "spmdsplit", "data", "gsm8k_sample.jsonl")
# Renders the messages' contents back to back, then "=" as the generation prompt: with the
# embedded character tokenizer, [{"role": "user", "content": "12"}] becomes the tokens of "12=".
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}={% endif %}"


def _load_script():
    spec = importlib.util.spec_from_file_location("make_gsm8k_parquet", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gsm8k = _load_script()


@pytest.fixture(scope="module")
def plain_tokenizer():
    return load_tokenizer(ensure_embedded_model())


@pytest.fixture(scope="module")
def chat_tokenizer():
    tokenizer = load_tokenizer(ensure_embedded_model())
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def tokens(tokenizer, text):
    return [tokenizer.convert_tokens_to_ids(c) for c in text]


def write(path, columns: dict, schema=None):
    pq.write_table(pa.table(columns, schema=schema), str(path))
    return str(path)


def msgs(text):
    return [{"role": "user", "content": text}]


def data_cfg(**overrides):
    return OmegaConf.merge(OmegaConf.structured(DataConfig), overrides)


# --------------------------------------------------------------------------- the GSM8K writer


def test_sample_holds_original_gsm8k_style_problems():
    problems = [json.loads(line) for line in open(SAMPLE, encoding="utf-8") if line.strip()]
    assert len(problems) >= 40
    answers = [gsm8k.ground_truth(p["answer"]) for p in problems]
    assert all(re.fullmatch(r"-?\d+", a) for a in answers)
    assert any(a.startswith("-") for a in answers)  # negative answers
    assert any(re.search(r"#### -?\d{1,3}(,\d{3})+$", p["answer"]) for p in problems)  # answers with commas
    assert len({p["question"] for p in problems}) == len(problems)


def test_ground_truth_drops_commas_and_keeps_the_sign():
    assert gsm8k.ground_truth("so 1,000 + 200 = 1,200.\n#### 1,200") == "1200"
    assert gsm8k.ground_truth("4 - 11 = -7\n#### -7") == "-7"
    with pytest.raises(ValueError, match="####"):
        gsm8k.ground_truth("the answer is 5")


def test_script_writes_verls_gsm8k_schema(tmp_path):
    written = gsm8k.main(["--out", str(tmp_path), "--train-rows", "50", "--test-rows", "12", "--seed", "3"])
    assert written == {"train": str(tmp_path / "train.parquet"), "test": str(tmp_path / "test.parquet")}
    schema = pq.read_schema(written["train"])
    assert schema.names == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    assert schema.field("prompt").type == pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
    assert set(schema.field("reward_model").type.names) == {"style", "ground_truth"}
    assert set(schema.field("extra_info").type.names) == {"split", "index", "answer", "question"}

    sample = [json.loads(line) for line in open(SAMPLE, encoding="utf-8") if line.strip()]
    questions = {}
    for split, n in (("train", 50), ("test", 12)):
        rows, report = read_parquet_rows(written[split])
        assert len(rows) == n and report["rows_read"] == n and report["malformed"] == {}
        for i, row in enumerate(rows):
            assert set(row) == {"prompt", "data_source", "ability", "reward_model", "extra_info", "agent_name", "source_row"}
            assert row["data_source"] == "openai/gsm8k" and row["ability"] == "math"
            question, answer = row["extra_info"]["question"], row["extra_info"]["answer"]
            assert row["prompt"] == [{"role": "user", "content": question + " " + gsm8k.INSTRUCTION}]
            assert row["prompt"][0]["content"].endswith('output the final answer after "####".')
            assert row["reward_model"] == {"ground_truth": gsm8k.ground_truth(answer), "style": "rule"}
            assert "," not in row["reward_model"]["ground_truth"]
            assert row["extra_info"]["split"] == split and row["extra_info"]["index"] == i
            assert row["source_row"] == f"{written[split]}:{i}"
        questions[split] = [r["extra_info"]["question"] for r in rows]
    # the hand-written problems come first, every 4th of them in the test split; no question is in both
    assert questions["train"][:5] == [p["question"] for p in sample[:3] + sample[4:6]]
    assert questions["test"][:2] == [sample[3]["question"], sample[7]["question"]]
    assert not set(questions["train"]) & set(questions["test"])
    assert len(set(questions["train"])) == 50


def test_script_is_seeded_and_zero_rows_means_the_source_only(tmp_path):
    def rows(out, *args):
        written = gsm8k.main(["--out", str(out), *args])
        return pq.read_table(written["train"]).to_pylist(), pq.read_table(written["test"]).to_pylist()

    a = rows(tmp_path / "a", "--train-rows", "60", "--test-rows", "20", "--seed", "1")
    assert rows(tmp_path / "b", "--train-rows", "60", "--test-rows", "20", "--seed", "1") == a
    assert rows(tmp_path / "c", "--train-rows", "60", "--test-rows", "20", "--seed", "2") != a
    train, test = rows(tmp_path / "d", "--train-rows", "0", "--test-rows", "0")
    n = sum(1 for line in open(SAMPLE, encoding="utf-8") if line.strip())
    assert len(train) + len(test) == n and len(test) == n // 4


def test_script_runs_from_the_command_line(tmp_path):
    out = subprocess.run(
        [sys.executable, SCRIPT, "--out", str(tmp_path / "gsm"), "--train-rows", "8", "--test-rows", "4"],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert pq.read_metadata(str(tmp_path / "gsm" / "train.parquet")).num_rows == 8
    assert pq.read_metadata(str(tmp_path / "gsm" / "test.parquet")).num_rows == 4


# --------------------------------------------------------------------------- malformed rows


@pytest.fixture
def bad_files(tmp_path):
    good = {"ground_truth": "1", "style": "rule"}
    a = write(
        tmp_path / "a.parquet",
        {
            "prompt": [msgs("12"), [], msgs("34"), msgs("56"), msgs("78"), msgs("90"), msgs("  "), None],
            "data_source": ["s", "s", "s", None, "s", "s", "s", "s"],
            "reward_model": [good, good, good, good, {"ground_truth": None, "style": "rule"}, good, good, good],
            "extra_info": [{"index": i} for i in range(8)],
        },
    )
    b = write(  # a prompt of the wrong type
        tmp_path / "b.parquet",
        {"prompt": [1, 2, 3], "data_source": ["s"] * 3, "reward_model": [good] * 3},
    )
    c = write(  # no data_source column at all
        tmp_path / "c.parquet", {"prompt": ["1=", "2="], "reward_model": [good] * 2}
    )
    d = write(  # reward_model without a ground_truth field
        tmp_path / "d.parquet", {"prompt": ["3=", "4=", "5="], "data_source": ["s"] * 3, "reward_model": [{"style": "rule"}] * 3}
    )
    return a, b, c, d


def test_malformed_rows_stop_with_counts_and_row_numbers(bad_files):
    a, b, c, d = bad_files
    with pytest.raises(DataError) as e:
        read_parquet_rows([a, b, c, d])
    msg = str(e.value)
    assert "data.train_files: 13 of 16 row(s) are malformed" in msg
    lines = {line.strip().split(" (")[0]: line for line in msg.splitlines()}
    assert f"2 row(s): {a}:1, {a}:6" in lines["empty prompt"]
    assert f"1 row(s): {a}:7" in lines["missing prompt"]
    assert f"3 row(s): {b}:0, {b}:1, {b}:2" in lines["prompt of wrong type"]
    assert f"3 row(s): {a}:3, {c}:0, {c}:1" in lines["missing data_source"]
    assert f"4 row(s): {a}:4, {d}:0, {d}:1, {d}:2" in lines["missing ground_truth"]
    assert "data.skip_malformed_rows=true" in msg


def test_skip_malformed_keeps_the_good_rows_and_counts_the_bad(bad_files):
    a, b, c, d = bad_files
    rows, report = read_parquet_rows([a, b, c, d], skip_malformed=True)
    assert [r["source_row"] for r in rows] == [f"{a}:0", f"{a}:2", f"{a}:5"]
    assert [r["prompt"] for r in rows] == [msgs("12"), msgs("34"), msgs("90")]
    assert [r["extra_info"] for r in rows] == [{"index": 0}, {"index": 2}, {"index": 5}]
    assert report["rows_read"] == 16 and report["skipped"] == 13 and report["rows"] == 3
    assert report["malformed"] == {
        "empty prompt": 2,
        "missing data_source": 3,
        "missing ground_truth": 4,
        "missing prompt": 1,
        "prompt of wrong type": 3,
    }
    assert report["malformed_examples"]["missing ground_truth"] == [f"{a}:4", f"{d}:0", f"{d}:1", f"{d}:2"]


def test_other_malformed_fields(tmp_path):
    good = {"ground_truth": "1", "style": "rule"}
    f = write(
        tmp_path / "f.parquet",
        {
            "prompt": [msgs("1"), [{"role": None, "content": "2"}], msgs("3"), msgs("4"), msgs("5")],
            "data_source": ["s", "s", "", "s", "s"],
            "ability": ["math", "math", "math", "math", None],
            "reward_model": [good, good, good, None, good],
            "extra_info": [{"k": 1}, {"k": 1}, {"k": 1}, {"k": 1}, None],
        },
    )
    with pytest.raises(DataError) as e:
        read_parquet_rows(f)
    msg = str(e.value)
    for reason, row in (("malformed message", 1), ("bad data_source", 2), ("missing reward_model", 3)):
        assert re.search(rf"{reason} \(.*\): 1 row\(s\): {re.escape(f)}:{row}$", msg, re.M), reason
    rows, report = read_parquet_rows(f, skip_malformed=True)
    assert [r["source_row"] for r in rows] == [f"{f}:0", f"{f}:4"]
    assert rows[1]["extra_info"] == {} and rows[1]["ability"] is None  # nulls are allowed there
    ints = write(tmp_path / "g.parquet", {"prompt": ["1="], "data_source": ["s"], "reward_model": [good], "extra_info": [3]})
    with pytest.raises(DataError, match="bad extra_info"):
        read_parquet_rows(ints)


def test_many_bad_rows_show_the_first_ten(tmp_path):
    f = write(tmp_path / "e.parquet", {"prompt": [""] * 25 + ["1="], "data_source": ["s"] * 26,
                                       "reward_model": [{"ground_truth": "1"}] * 26})
    with pytest.raises(DataError) as e:
        read_parquet_rows(f)
    msg = str(e.value)
    assert "25 row(s)" in msg and f"{f}:9," in msg and f"{f}:10," not in msg and "(15 more)" in msg


def test_file_level_errors_name_the_key_and_file(tmp_path):
    f = write(tmp_path / "q.parquet", {"question": ["1="], "data_source": ["s"], "reward_model": [{"ground_truth": "1"}]})
    for skip in (False, True):  # a missing prompt column is a wrong data.prompt_key, never skipped
        with pytest.raises(DataError) as e:
            read_parquet_rows(f, skip_malformed=skip)
        assert f in str(e.value) and "'prompt'" in str(e.value) and "question" in str(e.value)
    rows, _ = read_parquet_rows(f, prompt_key="question")
    assert rows[0]["prompt"] == "1="
    with pytest.raises(DataError, match=r"data\.val_files: no such file: .*nope\.parquet"):
        read_parquet_rows([str(tmp_path / "nope.parquet")], key="data.val_files")
    (tmp_path / "junk.parquet").write_text("not parquet")
    with pytest.raises(DataError, match="cannot read .*junk.parquet as parquet"):
        read_parquet_rows(str(tmp_path / "junk.parquet"))
    with pytest.raises(DataError, match="no parquet file"):
        read_parquet_rows("")
    only_bad = write(tmp_path / "bad.parquet", {"prompt": [""], "data_source": ["s"], "reward_model": [{"ground_truth": "1"}]})
    with pytest.raises(DataError, match="no usable rows"):
        read_parquet_rows(only_bad, skip_malformed=True)


def test_files_as_a_listconfig(bad_files):
    a = bad_files[0]
    files = OmegaConf.create({"f": [a, a]}).f
    rows, report = read_parquet_rows(files, skip_malformed=True)
    assert len(rows) == 6 and report["files"] == [a, a] and report["skipped"] == 10


# --------------------------------------------------------------------------- chat template, lengths


def test_render_prompt_uses_the_chat_template(chat_tokenizer, plain_tokenizer):
    assert render_prompt(msgs("12"), chat_tokenizer) == "12="
    assert render_prompt([{"role": "system", "content": "3"}, {"role": "user", "content": "45"}], chat_tokenizer) == "345="
    assert render_prompt("77=", chat_tokenizer) == "77="
    assert render_prompt("77=", plain_tokenizer) == "77="  # plain strings need no template
    with pytest.raises(DataError, match="no chat template"):
        render_prompt(msgs("12"), plain_tokenizer)


def test_collate_renders_messages(chat_tokenizer):
    rows = [
        {"prompt": msgs("12"), "data_source": "s", "reward_model": {"ground_truth": "a"}, "extra_info": {"k": 1}, "index": 7},
        {"prompt": "345=", "data_source": "t", "reward_model": {"ground_truth": "b"}, "extra_info": {}, "index": 8},
    ]
    batch = collate_prompts(rows, chat_tokenizer, 6, step=2, first_row=0)
    pad = chat_tokenizer.pad_token_id
    assert batch["input_ids"].tolist() == [[pad] * 3 + tokens(chat_tokenizer, "12="), [pad] * 2 + tokens(chat_tokenizer, "345=")]
    assert batch["attention_mask"].tolist() == [[0] * 3 + [1] * 3, [0] * 2 + [1] * 4]
    assert batch["ground_truth"] == ["a", "b"] and batch["extra_info"] == [{"k": 1}, {}] and batch["index"] == [7, 8]


@pytest.fixture
def length_rows():
    return [{"prompt": p, "data_source": "s", "reward_model": {"ground_truth": "1"}, "extra_info": {}}
            for p in ["12=", "123456789=", "4=", "98765432="]]


def test_truncation_left_right_and_error(plain_tokenizer, length_rows):
    tok = plain_tokenizer
    left = collate_prompts(length_rows, tok, 5, step=1, first_row=0, truncation="left")
    right = collate_prompts(length_rows, tok, 5, step=1, first_row=0, truncation="right")
    pad = tok.pad_token_id
    assert left["input_ids"].tolist() == [
        [pad] * 2 + tokens(tok, "12="), tokens(tok, "6789="), [pad] * 3 + tokens(tok, "4="), tokens(tok, "5432=")]
    assert right["input_ids"].tolist() == [
        [pad] * 2 + tokens(tok, "12="), tokens(tok, "12345"), [pad] * 3 + tokens(tok, "4="), tokens(tok, "98765")]
    assert left["attention_mask"].tolist()[1] == [1] * 5
    with pytest.raises(ValueError) as e:
        collate_prompts(length_rows, tok, 5, step=1, first_row=10)
    msg = str(e.value)
    assert "2 prompt(s) longer than data.max_prompt_length=5" in msg and "(11, 10)" in msg and "(13, 9)" in msg
    assert "data.filter_overlong_prompts=true" in msg and "data.truncation" in msg
    with pytest.raises(ValueError, match="data.truncation"):
        collate_prompts(length_rows, tok, 5, step=1, first_row=0, truncation="middle")


def test_filter_overlong_prompts_counts_the_dropped(plain_tokenizer, chat_tokenizer, length_rows):
    assert prompt_lengths(length_rows, plain_tokenizer) == [3, 10, 2, 9]
    kept, dropped = filter_overlong_prompts(length_rows, plain_tokenizer, 9)  # verl keeps length <= max
    assert [r["prompt"] for r in kept] == ["12=", "4=", "98765432="] and dropped == 1
    kept, dropped = filter_overlong_prompts(length_rows, plain_tokenizer, 2)
    assert [r["prompt"] for r in kept] == ["4="] and dropped == 3
    chat = [dict(r, prompt=msgs(r["prompt"][:-1])) for r in length_rows]  # the template adds the "="
    assert prompt_lengths(chat, chat_tokenizer) == [3, 10, 2, 9]
    assert filter_overlong_prompts(chat, chat_tokenizer, 3)[1] == 2


# --------------------------------------------------------------------------- build_rows


def test_build_rows_without_files_is_the_synthetic_task(plain_tokenizer):
    cfg = data_cfg(num_train_samples=300, seed=5)
    train, report = build_rows(cfg, plain_tokenizer, "train")
    assert len(train) == 300 and report["source"] == "synthetic/repeat" and report["filtered_overlong"] == 0
    assert [r["index"] for r in train] == list(range(300))
    assert all(r["extra_info"] == {"index": i} for i, r in enumerate(train))
    assert set(train[0]) == {"prompt", "data_source", "ability", "reward_model", "extra_info", "agent_name", "source_row", "index"}
    assert isinstance(train[0]["prompt"], str) and train[0]["reward_model"]["style"] == "rule"
    val, vreport = build_rows(cfg, plain_tokenizer, "val")
    assert len(val) == SYNTHETIC_VAL_SAMPLES == vreport["rows"] and vreport["split"] == "val"
    assert [r["prompt"] for r in val] != [r["prompt"] for r in train[:SYNTHETIC_VAL_SAMPLES]]
    assert build_rows(cfg, plain_tokenizer, "val")[0] == val  # seeded
    assert "300 row(s) of the synthetic task synthetic/repeat" in format_report(report)
    # the synthetic rows collate as before
    batch = collate_prompts(train[:4], plain_tokenizer, cfg.max_prompt_length, step=1, first_row=0)
    assert batch["input_ids"].shape == (4, cfg.max_prompt_length)
    # synthetic prompts are not length-checked up front (they are short by design): collate checks them
    tiny, _ = build_rows(data_cfg(num_train_samples=50, max_prompt_length=2), plain_tokenizer, "train")
    with pytest.raises(ValueError, match="data.max_prompt_length=2"):
        collate_prompts(tiny, plain_tokenizer, 2, step=1, first_row=0)


@pytest.fixture(scope="module")
def gsm_files(tmp_path_factory):
    return gsm8k.main(["--out", str(tmp_path_factory.mktemp("gsm")), "--train-rows", "40", "--test-rows", "16"])


def test_build_rows_from_parquet_files(gsm_files, chat_tokenizer, plain_tokenizer):
    cfg = data_cfg(train_files=[gsm_files["train"]], val_files=gsm_files["test"], max_prompt_length=512)
    train, report = build_rows(cfg, chat_tokenizer, "train")
    val, vreport = build_rows(cfg, chat_tokenizer, "val")
    assert len(train) == 40 and len(val) == 16 and report["source"] == vreport["source"] == "parquet"
    assert [r["index"] for r in train] == list(range(40))
    assert [r["extra_info"]["index"] for r in val] == list(range(16)) and val[0]["extra_info"]["split"] == "test"
    assert "40 row(s) from 1 parquet file(s)" in format_report(report)
    # chat messages need a tokenizer with a chat template
    with pytest.raises(DataError, match=r"data\.train_files: .*no chat template"):
        build_rows(cfg, plain_tokenizer, "train")
    # prompts too long: an error before any training, unless filtered or truncated
    lengths = sorted(prompt_lengths(train, chat_tokenizer))
    short = data_cfg(train_files=gsm_files["train"], max_prompt_length=lengths[9])
    with pytest.raises(DataError) as e:
        build_rows(short, chat_tokenizer, "train")
    assert "longer than data.max_prompt_length" in str(e.value) and gsm_files["train"] + ":" in str(e.value)
    kept, freport = build_rows(OmegaConf.merge(short, {"filter_overlong_prompts": True}), chat_tokenizer, "train")
    assert freport["filtered_overlong"] == 40 - len(kept) == sum(n > lengths[9] for n in lengths)
    assert [r["index"] for r in kept] == list(range(len(kept)))
    assert f"dropped {freport['filtered_overlong']} prompt(s)" in format_report(freport)
    cut, _ = build_rows(OmegaConf.merge(short, {"truncation": "left"}), chat_tokenizer, "train")
    assert len(cut) == 40


def test_build_rows_malformed_parquet(bad_files, plain_tokenizer):
    cfg = data_cfg(train_files=list(bad_files), max_prompt_length=8)
    with pytest.raises(DataError, match="data.skip_malformed_rows=true"):
        build_rows(cfg, None, "train")
    rows, report = build_rows(OmegaConf.merge(cfg, {"skip_malformed_rows": True}), None, "train")
    assert len(rows) == 3 and report["skipped"] == 13
    assert "skipped 13 malformed" in format_report(report)
    with pytest.raises(DataError, match=r"data\.val_files"):
        build_rows(data_cfg(val_files=[str(bad_files[0]) + ".missing"]), None, "val")


def test_prompt_dataset_over_parquet_rows_is_deterministic(gsm_files, chat_tokenizer):
    cfg = data_cfg(train_files=gsm_files["train"], max_prompt_length=512)
    a = PromptDataset(build_rows(cfg, chat_tokenizer, "train")[0], 8, shuffle=True, seed=3)
    b = PromptDataset(build_rows(cfg, chat_tokenizer, "train")[0], 8, shuffle=True, seed=3)
    assert a.steps_per_epoch == 5
    ids = lambda rows: [r["source_row"] for r in rows]  # noqa: E731
    for step in (1, 4, 6, 11, 2):
        assert ids(a.global_batch(step)) == ids(b.global_batch(step))
    epochs = [[r["index"] for s in range(e * 5 + 1, e * 5 + 6) for r in a.global_batch(s)] for e in range(3)]
    assert all(sorted(e) == list(range(40)) for e in epochs)
    assert epochs[0] != epochs[1] != epochs[2]
    batch = collate_prompts(a.shard(6, 1, 2), chat_tokenizer, 512, step=6, first_row=4)
    assert batch["index"] == [r["index"] for r in a.global_batch(6)[4:]]
