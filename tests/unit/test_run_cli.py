"""`triton-disagg run`: JSON output equals the engine's, errors are one line with exit 2."""

import json

import pytest

from triton_disagg.cli import main
from triton_disagg.engine.llm_engine import LLMEngine
from triton_disagg.engine.sampling import SamplingParams
from triton_disagg.engine.spec import EngineSpec
from triton_disagg.front.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def engine_dir(tiny_engines):
    return tiny_engines["llama"]


def run_json(capsys, *argv) -> dict:
    assert main(["run", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def engine_output(engine_dir, prompt, **params) -> list[int]:
    eos = EngineSpec.load(engine_dir).eos_token_id
    (seq,) = LLMEngine(engine_dir).generate([prompt], SamplingParams(**{"end_id": eos, **params}))
    return seq.output_ids


def test_input_ids_json_equals_engine_output(engine_dir, capsys):
    out = run_json(capsys, "--engine", str(engine_dir), "--input-ids", "5,6,7,8",
                   "--max-tokens", "12")
    assert out["input_ids"] == [5, 6, 7, 8]
    assert out["output_ids"] == engine_output(engine_dir, [5, 6, 7, 8], max_tokens=12)
    assert out["text"] == Tokenizer(engine_dir).decode(out["output_ids"])


def test_torch_runtime_on_cpu_equals_numpy(engine_dir, capsys):
    argv = ["--engine", str(engine_dir), "--input-ids", "5,6,7,8", "--max-tokens", "12"]
    torch_out = run_json(capsys, *argv, "--runtime", "torch", "--device", "cpu")
    assert torch_out == run_json(capsys, *argv, "--runtime", "numpy")


def test_text_prompt_sampling_options_and_stop_words(engine_dir, capsys):
    tokenizer = Tokenizer(engine_dir)
    prompt = tokenizer.encode("Hello there, world")
    assert prompt[0] == EngineSpec.load(engine_dir).bos_token_id    # as the tokenizer says
    argv = ["--engine", str(engine_dir), "--text", "Hello there, world", "--max-tokens", "10",
            "--temperature", "0.8", "--top-k", "40", "--top-p", "0.9", "--seed", "3",
            "--repetition-penalty", "1.1", "--presence-penalty", "0.2",
            "--frequency-penalty", "0.1", "--min-tokens", "2", "--bad-words", "the"]
    out = run_json(capsys, *argv)
    assert out["input_ids"] == prompt
    assert out["output_ids"] == engine_output(
        engine_dir, prompt, max_tokens=10, temperature=0.8, top_k=40, top_p=0.9, seed=3,
        repetition_penalty=1.1, presence_penalty=0.2, frequency_penalty=0.1, min_tokens=2,
        bad_words=[tokenizer.encode_word("the")])
    # A generated token whose text round-trips through the tokenizer, as a stop word.
    stop = next(t for t in out["output_ids"][1:]
                if tokenizer.encode_word(tokenizer.decode([t])) == [t])
    stopped = run_json(capsys, *argv, "--stop-words", tokenizer.decode([stop]))
    assert stopped["output_ids"] == out["output_ids"][:out["output_ids"].index(stop) + 1]


def test_plain_output_is_the_text(engine_dir, capsys):
    argv = ["run", "--engine", str(engine_dir), "--input-ids", "5,6", "--max-tokens", "6"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    ids = engine_output(engine_dir, [5, 6], max_tokens=6)
    assert text == Tokenizer(engine_dir).decode(ids) + "\n"


def test_text_gets_the_tokenizers_bos_unless_told_not_to(engine_dir, capsys):
    argv = ["--engine", str(engine_dir), "--text", "Hi", "--max-tokens", "1"]
    plain = run_json(capsys, *argv, "--no-special-tokens")["input_ids"]
    assert plain == Tokenizer(engine_dir).encode("Hi", add_special_tokens=False)
    assert run_json(capsys, *argv)["input_ids"] == [EngineSpec.load(engine_dir).bos_token_id,
                                                    *plain]


@pytest.mark.parametrize("argv, message", [
    (["--engine", "/nonexistent/engine", "--input-ids", "1"], "engine.json: not found"),
    (["--input-ids", "1,x"], "--input-ids"),
    (["--input-ids", "1,99999999"], "outside the vocabulary"),
    (["--input-ids", ""], "prompt is empty"),
    (["--input-ids", "1", "--top-p", "0"], "top_p"),
    (["--input-ids", "1", "--runtime", "numpy", "--device", "cuda"], "needs model.runtime: torch"),
    (["--input-ids", "1", "--runtime", "torch", "--device", "cuda"], "no CUDA GPU"),
])
def test_errors_exit_2_with_one_line(engine_dir, capsys, argv, message):
    if "--engine" not in argv:
        argv = ["--engine", str(engine_dir), *argv]
    assert main(["run", *argv, "--max-tokens", "4"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and err.startswith("triton-disagg run: error:")
