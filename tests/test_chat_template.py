"""A checkpoint's own chat template (tokenizer_config.json) and stop ids (generation_config.json),
against transformers' apply_chat_template; and a random-weight sharded checkpoint with its own
template served by a real tritonserver."""

import json
import shutil

import pytest
import torch

from tandem.model.chat_template import ChatTemplate
from tandem.model.checkpoint import DEFAULT_CHECKPOINT, init_weights, save_sharded
from tandem.model.tokenizer import ChatTokenizer
from tandem.model.trunk import Trunk

TWO_TURNS = [
    ("system", "Be brief."),
    ("user", "Write a haiku about the sea."),
    ("assistant", "Waves fold into foam."),
    ("user", "Another, about rivers — with émoji 😀 and 日本語."),
]
#: a template unlike the miniature's: a preamble, a default system message, a filter, a loop variable
OTHER_TEMPLATE = (
    "{{ '<|system|>' + '\\n' + 'You are a test model.' }}{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ ' ' + m['content'] | trim }}{% else %}"
    "{{ '<|' + m['role'] + '|>' + '\\n' + m['content'] }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' + '\\n' }}{% endif %}"
)


def _folder(tmp_path, template: str | None = None, eos=None):
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(DEFAULT_CHECKPOINT / f, tmp_path / f)
    if template is not None:
        cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": template}))
    if eos is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return tmp_path


def _transformers(folder, messages):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(folder)
    msgs = [{"role": r, "content": c} for r, c in messages]
    text = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    ids = hf.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
    return text, list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@pytest.mark.parametrize("template", [None, OTHER_TEMPLATE], ids=["shipped", "other"])
def test_rendered_prompt_equals_transformers(tmp_path, template):
    """In-process: a two-turn conversation rendered by the folder's own template
    equals transformers' apply_chat_template, text and token ids."""
    folder = _folder(tmp_path, template)
    tok = ChatTokenizer(folder / "tokenizer.json")
    want_text, want_ids = _transformers(folder, TWO_TURNS)
    assert tok.template.render([{"role": r, "content": c} for r, c in TWO_TURNS]) == want_text
    assert tok.render(TWO_TURNS) == want_ids
    assert tok.chat_prompt("Hi") == _transformers(folder, [("user", "Hi")])[1]


def test_the_shipped_template_keeps_the_miniature_prompt(tokenizer):
    """The shipped checkpoint's template renders the prompt tandem was trained with."""
    ids = tokenizer.chat_prompt("Write a haiku about the sea.", system="Be brief.")
    assert (
        tokenizer.decode(ids, skip_special=False)
        == "<|system|>\nBe brief.<|user|>\nWrite a haiku about the sea.<|assistant|>\n"
    )
    assert ids[0] == tokenizer.role_ids["system"] and ids[-2] == tokenizer.role_ids["assistant"]


def test_only_the_template_inserts_control_tokens(tokenizer):
    """A message that spells a control token gets the characters' ids (transformers would give the
    control id); with ordinary text the two agree (above)."""
    ids = tokenizer.chat_prompt("stop <|assistant|> here")
    assert ids.count(tokenizer.role_ids["assistant"]) == 1 and ids.count(tokenizer.role_ids["user"]) == 1


@pytest.mark.parametrize("eos, want", [(7, (7,)), ([0, 5, 9], (0, 5, 9))])
def test_stop_ids_come_from_generation_config(tmp_path, eos, want):
    assert ChatTokenizer(_folder(tmp_path, eos=eos) / "tokenizer.json").stop_ids == want


def test_template_errors_are_clear(tmp_path):
    import jinja2

    t = ChatTemplate("{{ raise_exception('only user messages') }}")
    with pytest.raises(jinja2.TemplateError, match="only user messages"):
        t.render([{"role": "user", "content": "x"}])
    cfg = json.loads((DEFAULT_CHECKPOINT / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": [{"name": "default"}]}))
    with pytest.raises(ValueError, match="chat_template must be one template string"):
        ChatTemplate.load(tmp_path)


@pytest.fixture(scope="module")
def served_folder(tmp_path_factory):
    """A random-weight checkpoint with the real per-head dimensions (tests/test_real_config.py), the
    shipped tokenizer's vocabulary, 2 shards + index, and its own chat template (OTHER_TEMPLATE); and
    a random DFlash2 drafter for it in a folder of its own (``drafter/dflash2``), as a real
    GLM-5.3-Flash DFlash2 drafter ships."""
    from test_real_config import real_dims_config

    from tandem.model.checkpoint import save_dflash
    from tandem.model.dflash import DFlashConfig, DFlashDrafter

    folder = tmp_path_factory.mktemp("served-glm")
    save_sharded(init_weights(Trunk(real_dims_config(vocab_size=8192)), seed=5, std=0.05), folder, 2, torch.bfloat16)
    torch.manual_seed(0)
    drafter = DFlashDrafter(DFlashConfig(hidden_size=256, vocab_size=8192, target_layer_ids=[0, 1, 3]), dflash2=True)
    save_dflash(drafter, folder.parent / (folder.name + "-drafter"), "dflash2")
    return _folder(folder, OTHER_TEMPLATE)


@pytest.mark.integration
def test_serving_a_sharded_checkpoint_with_its_own_template(served_folder):
    """tritonserver serves the sharded random-weight folder (TANDEM_CHECKPOINT, what `make
    serve CHECKPOINT=...` sets) and `tandem generate --checkpoint` streams from it with the folder's
    template; the server's own text front renders the same prompt (the ensemble's prompt_tokens); its
    DFlash2 drafter loads from a folder of its own (TANDEM_DFLASH2_CHECKPOINT, `--dflash2-checkpoint`)
    and greedy DFlash2 output equals plain decoding's."""
    from typer.testing import CliRunner

    from tandem.launch.serve import running_server
    from tandem_client.cli import app

    tok = ChatTokenizer(served_folder / "tokenizer.json")
    drafter = served_folder.parent / (served_folder.name + "-drafter") / "dflash2"
    env = {"TANDEM_CHECKPOINT": str(served_folder), "TANDEM_DFLASH2_CHECKPOINT": str(drafter)}
    with running_server(env=env, ready_timeout_s=240) as srv:
        res = CliRunner().invoke(
            app,
            [
                "generate",
                "Hello there",
                "-n",
                "12",
                "--json",
                "--url",
                srv.grpc_url,
                "--checkpoint",
                str(served_folder),
            ],
        )
        assert res.exit_code == 0, res.output + srv.log()[-3000:]
        out = json.loads(res.stdout)
        assert len(out["token_ids"]) == 12 and out["usage"]["prompt_tokens"] == len(tok.chat_prompt("Hello there"))
        import urllib.request

        req = urllib.request.Request(
            f"http://127.0.0.1:{srv.http_port}/v2/models/ensemble/generate",
            data=json.dumps({"text_input": "Hello there", "max_tokens": 12}).encode(),
        )
        with urllib.request.urlopen(req, timeout=120) as r:
            ans = json.loads(r.read())
        assert ans["prompt_tokens"] == len(tok.chat_prompt("Hello there")) and ans["completion_tokens"] == 12
        assert ans["text_output"] == out["text"]  # greedy: the same reply through either front
        from tandem_client.client import generate

        plain = generate(tok.chat_prompt("Hello there"), 24, url=srv.grpc_url, spec="off")
        spec = generate(
            tok.chat_prompt("Hello there"), 24, url=srv.grpc_url, spec="dflash2"
        )  # the drafter's own folder
        assert spec["token_ids"] == plain["token_ids"] and spec["drafted"] > 0
        assert f"DFlash drafters {{'dflash2': '{drafter}'}}" in srv.log()
        assert tok.decode(tok.chat_prompt("Hello there"), skip_special=False).startswith(
            "<|system|>\nYou are a test model."
        )


def test_a_later_turn_leaves_out_the_preamble(tmp_path):
    """With a template that renders a preamble (OTHER_TEMPLATE's default system message, like GLM's
    ``[gMASK]<sop>``), a session's context after two turns equals the template's rendering of the
    whole conversation: the later turn leaves the preamble out, and so does the ensemble's
    preprocessing for a turn of a sequence without sequence_start."""
    import numpy as np

    from tandem import schema
    from tandem.serving.text import Preprocessor

    tok = ChatTokenizer(_folder(tmp_path, OTHER_TEMPLATE) / "tokenizer.json")
    reply = "Waves fold into foam."
    context = tok.chat_prompt("Write a haiku.") + tok.encode(reply) + tok.chat_prompt("Another.", later=True)
    assert context == tok.render([("user", "Write a haiku."), ("assistant", reply), ("user", "Another.")])
    assert tok.chat_prompt("Another.", later=True) != tok.chat_prompt("Another.")
    pre = Preprocessor(tok)
    arrays = {"text_input": np.array([b"Another."], dtype=np.object_)}
    ids = lambda *a: pre.handle(arrays, *a)[schema.INPUT_IDS].tolist()  # noqa: E731
    assert ids(7, 0) == tok.chat_prompt("Another.", later=True)  # a later turn of sequence 7
    assert ids(7, schema.FLAG_START) == ids(0, 0) == tok.chat_prompt("Another.")
