"""Chat with a trained kt-ft adapter of the tiny vision-language demo (Qwen3-VL-MoE): LLaMA-Factory's
``ChatModel`` (what ``llamafactory-cli chat`` / ``api`` / ``webchat`` load) with ``use_kt: true`` and
a picture, its greedy tokens against the adapter merged into the base (``kt-ft merge``) and run by
LLaMA-Factory with ``use_kt: false``, pictures refused where the model cannot read them, and the
``chat`` and ``api`` commands as subprocesses.

The model is random and trained 4 steps: it "answers" with a token or two ("A."), not about the
picture; what is checked is that the picture goes through the pipeline (its tokens in the prompt,
the vision tower in the forward) and that kt-ft's experts give the reference's tokens. Training is
seeded (``seed=42``, printed); generation is greedy, no sampling.

Tolerance: none, token for token. Both sides are fp32 and compute the same function (x @ (W + s B A)
against x @ W + s (x @ A) @ B, top-k summed in another order): logits differ by ~1e-6 relative
(test_multimodal.py's merge test: 1e-5), and the test asserts the reference's smallest gap between
its top two logits over every generated position is far larger (> 1e-4), so a different token is a
bug, not rounding.
"""

from __future__ import annotations

import subprocess
import threading
from pathlib import Path

import pytest
import torch

pytest.importorskip("llamafactory")

from helpers.lf_api import MISSING_API, http_json, start_api, stop_api, stream_text  # noqa: E402
from helpers.lf_runs import CLI, REPO  # noqa: E402
from helpers.vl_runs import train  # noqa: E402

from kt_ft.base.errors import KTConfigError  # noqa: E402
from kt_ft.integrations.demo.vision import make_demo_vl_model  # noqa: E402

SEED = 42  # vl_runs.train's training seed
NEW_TOKENS = 12
QUESTION = "What is in the picture?"
MIN_TOP2_GAP = 1e-4  # see the module doc
CHAT = dict(template="qwen3_vl_nothink", image_max_pixels=4096, do_sample=False, max_new_tokens=NEW_TOKENS)
KT = dict(finetuning_type="lora", use_kt=True, cpu_infer=1, kt_backend="torch")


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def vl_assets(tmp_path_factory):
    return make_demo_vl_model(tmp_path_factory.mktemp("demo_vl"), n=16)


@pytest.fixture(scope="module")
def adapter(vl_assets, tmp_path_factory):
    """Vision tower, language model and experts trained 4 steps on the pictures (seeded)."""
    print(f"training seed {SEED}")
    return train(vl_assets, tmp_path_factory.mktemp("chat") / "out", freeze_vision_tower=False, seed=SEED)


@pytest.fixture(scope="module")
def merged(adapter, tmp_path_factory) -> Path:
    from kt_ft.integrations.cli.main import main

    out = tmp_path_factory.mktemp("merged") / "model"
    assert main(["merge", str(adapter), str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def kt_chat(vl_assets, adapter):
    """LLaMA-Factory's ChatModel of the base + adapter, kt-ft's experts."""
    from llamafactory.chat import ChatModel

    return ChatModel(
        dict(model_name_or_path=str(vl_assets / "model"), adapter_name_or_path=str(adapter), **KT, **CHAT)
    )


@pytest.fixture(scope="module")
def ref_chat(merged):
    """The merged model through LLaMA-Factory without kt-ft."""
    from llamafactory.chat import ChatModel

    return ChatModel(dict(model_name_or_path=str(merged), **CHAT))


def picture(assets: Path, i: int):
    from PIL import Image

    return Image.open(assets / "data" / "images" / f"{i:03d}.png").convert("RGB")


def ask(with_image: bool = True) -> list[dict[str, str]]:
    return [{"role": "user", "content": ("<image>" if with_image else "") + QUESTION}]


def count_calls(model, type_name: str) -> dict[str, int]:
    """Forward calls of every module of ``type_name``, counted from now on (hooks stay)."""
    calls: dict[str, int] = {}
    for name, module in model.named_modules():
        if type(module).__name__ == type_name:
            calls[name] = 0
            module.register_forward_hook(lambda m, i, o, n=name: calls.__setitem__(n, calls[n] + 1))
    return calls


def streamed(chat_model, messages, images, timeout: float = 60) -> str:
    """``stream_chat`` joined, within ``timeout``: LLaMA-Factory's streamer waits without a timeout,
    so a generation that dies in its thread would otherwise hang the test."""
    out: list[str] = []
    t = threading.Thread(
        target=lambda: out.extend(chat_model.stream_chat(messages, images=images)), daemon=True
    )
    t.start()
    t.join(timeout)
    assert not t.is_alive(), (
        f"stream_chat gave no end after {timeout} s (its generate thread died?); got {out}"
    )
    return "".join(out)


# --------------------------------------------------------------------------- in process


def test_chat_answers_about_an_image(kt_chat, vl_assets):
    """ChatModel with the adapter and a picture: a non-empty answer, the picture's tokens in the
    prompt (4 merged patches of a 64x64 picture between <|vision_start|> and <|vision_end|>), the
    vision tower and kt-ft's experts in the forward (the experts once per generated token: the
    prompt, then one call per new token with the KV cache); `stream_chat` (the CLI's call, in a
    thread without inference mode, after `chat` ran under it) streams the same answer."""
    model = kt_chat.engine.model
    experts = count_calls(model, "KTExperts")
    vision = count_calls(model, "Qwen3VLMoeVisionModel")
    assert len(experts) == 2 and len(vision) == 1
    answer = kt_chat.chat(ask(), images=[picture(vl_assets, 0)])[0]
    print(f"answer {answer}")
    assert answer.response_text.strip() and answer.response_length >= 1
    assert set(experts.values()) == {answer.response_length}, experts
    assert set(vision.values()) == {1}, vision
    text_only = kt_chat.chat(ask(with_image=False))[0]
    assert answer.prompt_length == text_only.prompt_length + 6
    assert streamed(kt_chat, ask(), [picture(vl_assets, 0)]) == answer.response_text


def _generate(chat_model, image) -> tuple[dict, object]:
    """The chat's own inputs (LLaMA-Factory's ``HuggingfaceEngine._process_args``: template, mm plugin,
    processor) and a greedy generation of exactly NEW_TOKENS tokens from them, with the scores. An
    end-of-turn token is suppressed until then (min_new_tokens), so every answer is NEW_TOKENS long
    and every decode step runs, whatever the random model would stop at."""
    from llamafactory.chat.hf_engine import HuggingfaceEngine

    e = chat_model.engine
    kwargs, _ = HuggingfaceEngine._process_args(
        e.model,
        e.tokenizer,
        e.processor,
        e.template,
        e.generating_args,
        ask(),
        None,
        None,
        [image],
        None,
        None,
        {},
    )
    config = kwargs["generation_config"]
    config.min_new_tokens = config.max_new_tokens = NEW_TOKENS
    config.return_dict_in_generate = config.output_scores = True
    with torch.inference_mode():  # as LLaMA-Factory's _chat
        return kwargs, e.model.generate(**kwargs)


def test_greedy_tokens_equal_the_merged_model_without_kt(kt_chat, ref_chat, vl_assets):
    """Greedy generation with kt-ft's experts equals, token for token, the merged model's through
    LLaMA-Factory with use_kt false, on the same pictures and question (tolerance: module doc); the
    pictures change the tokens (seen: three pictures, three answers)."""
    print(f"training seed {SEED}; greedy, {NEW_TOKENS} tokens")
    answers = set()
    for i in (0, 1, 2):
        image = picture(vl_assets, i)
        kt_in, kt_out = _generate(kt_chat, image)
        ref_in, ref_out = _generate(ref_chat, image)
        assert torch.equal(kt_in["inputs"], ref_in["inputs"])
        assert torch.equal(kt_in["pixel_values"], ref_in["pixel_values"])
        prompt = kt_in["inputs"].shape[1]
        got, want = kt_out.sequences[0, prompt:].tolist(), ref_out.sequences[0, prompt:].tolist()
        top2 = torch.stack(ref_out.scores).float().topk(2, dim=-1).values
        gap = (top2[..., 0] - top2[..., 1]).min().item()
        print(f"picture {i:03d}: kt {got} / merged {want}; smallest top-2 gap {gap:.3g}")
        assert len(got) == NEW_TOKENS
        assert gap > MIN_TOP2_GAP, f"a near-tie ({gap:.3g}) would make the comparison a coin toss"
        assert got == want, f"picture {i:03d}: use_kt {got} != merged {want}"
        answers.add(tuple(got))
    assert len(answers) > 1, "every picture gives the same tokens: the pictures would not matter"


def test_pictures_a_model_cannot_read_are_refused(vl_assets, demo_assets, merged):
    """An image given to a text-only model (use_kt) is refused naming the model and what it lacks;
    a vision-language model chatting through a text template is told its template; without kt-ft,
    LLaMA-Factory's own message is unchanged."""
    from llamafactory.chat import ChatModel

    image = picture(vl_assets, 0)
    text = ChatModel(dict(model_name_or_path=str(demo_assets / "model"), template="qwen", **KT))
    with pytest.raises(
        KTConfigError, match=r"model_name_or_path=\S+ is a qwen3_moe model with no vision_config"
    ):
        text.chat(ask(), images=[image])
    vl = ChatModel(dict(model_name_or_path=str(vl_assets / "model"), **KT, **{**CHAT, "template": "qwen3"}))
    with pytest.raises(KTConfigError, match="takes none: .* set template: qwen3_vl"):
        vl.chat(ask(), images=[image])
    plain = ChatModel(dict(model_name_or_path=str(merged), **{**CHAT, "template": "qwen3"}))
    with pytest.raises(ValueError, match="does not support image input") as err:
        plain.chat(ask(), images=[image])
    assert not isinstance(err.value, KTConfigError)


# --------------------------------------------------------------------------- commands


def _serve_recipe(path: Path, assets: Path, adapter: Path) -> Path:
    keys = {
        "model_name_or_path": assets / "model",
        "adapter_name_or_path": adapter,
        "infer_backend": "huggingface",
        **KT,
        **CHAT,
    }
    path.write_text(
        "".join(f"{k}: {str(v).lower() if isinstance(v, bool) else v}\n" for k, v in keys.items())
    )
    return path


@pytest.mark.lf_subprocess
def test_cli_chat_answers_through_stdin(kt_chat, vl_assets, adapter, tmp_path):
    """`llamafactory-cli chat` with the adapter, driven through stdin: it loads the expert LoRA and
    answers as ChatModel does. LLaMA-Factory 0.9.5's CLI chat reads text only (no image prompt):
    pictures go through ChatModel, the api or webchat."""
    recipe = _serve_recipe(tmp_path / "chat.yaml", vl_assets, adapter)
    proc = subprocess.run(
        [str(CLI), "chat", str(recipe)],
        input=f"{QUESTION}\nexit\n",
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=180,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "loaded expert LoRA from" in out, out[-3000:]
    answers = [line.split("Assistant: ", 1)[1] for line in out.splitlines() if "Assistant: " in line]
    want = kt_chat.chat(ask(with_image=False))[0].response_text
    assert answers == [want] and want.strip(), out[-3000:]


@pytest.mark.lf_subprocess
@pytest.mark.skipif(bool(MISSING_API), reason=f"LLaMA-Factory's api needs {', '.join(MISSING_API)}")
def test_api_answers_about_an_image(kt_chat, vl_assets, adapter, tmp_path):
    """`llamafactory-cli api` with the adapter: an OpenAI-style message with the picture as a base64
    image_url part gets ChatModel's answer, plain and streamed."""
    import base64

    recipe = _serve_recipe(tmp_path / "serve.yaml", vl_assets, adapter)
    png = (vl_assets / "data" / "images" / "000.png").read_bytes()
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": QUESTION}]
    request = {"model": "demo", "messages": [{"role": "user", "content": content}], "do_sample": False}
    want = kt_chat.chat(ask(), images=[picture(vl_assets, 0)])[0].response_text
    log_path = tmp_path / "api.log"
    proc, base = start_api(recipe, log_path)
    try:
        reply = http_json(f"{base}/chat/completions", request)
        assert reply["choices"][0]["message"]["content"] == want, reply
        assert stream_text(f"{base}/chat/completions", request) == want
    finally:
        rc = stop_api(proc)
    assert rc == 0, log_path.read_text()[-3000:]
