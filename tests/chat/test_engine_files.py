"""Our renderer and tokenizer against the ds4 engine's own checkpoint files (shared/testdata/ds4-engine).

Each file's text is the engine's rendered prompt (a prefix of it, or the prompt plus generated text)
and its payload holds the engine's token ids. For every request of manifest.json we render the body
and check: the file texts are byte prefixes of our text (or extend it), our ids equal the engine's
ids over the prompt, and our prompt length equals the prompt token count the engine reported.
"""

from __future__ import annotations

import re

import pytest

from ds4_vllm.chat.chat_request import render_chat_completion
from ds4_vllm.chat.responses_request import render_responses
from ds4_vllm.chat.template import RenderedPrompt
from ds4_vllm.chat.tokenizer import EOS, THINK_END, THINK_START, default_tokenizer
from ds4_vllm.kvc import open_checkpoint
from tests.shared_data import ENGINE_TESTDATA, require

TESTDATA = ENGINE_TESTDATA
CTX = {"q2": 16384, "q4": 20000, "rewrite": 20000}  # the -c of each run (manifest "runs")

require(TESTDATA / "manifest.json", "the ds4 engine's test files")


class EngineFile:
    def __init__(self, entry: dict) -> None:
        self.entry = entry
        with open_checkpoint(TESTDATA / entry["path"]) as ck:
            self.text = bytes(ck.text)
            self.tokens = [int(t) for t in ck.payload.tokens]
            self.tool_map = {e.tool_id.decode(): e.dsml.decode() for e in ck.tool_map.entries}


@pytest.fixture(scope="module")
def files(manifest: dict) -> dict[str, EngineFile]:
    return {f["path"]: EngineFile(f) for f in manifest["files"]}


@pytest.fixture(scope="module")
def rendered(manifest: dict, files: dict[str, EngineFile]) -> dict[str, RenderedPrompt]:
    # Exact replay from the KTM trailers of every file in the directory, as the engine pre-scans them.
    memory: dict[str, str] = {}
    for f in files.values():
        memory.update(f.tool_map)
    out = {}
    for name, req in manifest["requests"].items():
        if "body" not in req:
            continue  # R5, Q2, W1 repeat R1's body
        render = render_responses if req["endpoint"].endswith("/v1/responses") else render_chat_completion
        out[name] = render(req["body"].encode(), ctx_size=CTX[req["run"]], replay=memory.get)
    return out


def _reported(manifest: dict, request: str, pattern: str) -> int:
    m = re.search(pattern, manifest["requests"][request]["outcome"])
    assert m, manifest["requests"][request]["outcome"]
    return int(m.group(1))


def _file(files: dict[str, EngineFile], prefix: str) -> EngineFile:
    (match,) = [f for p, f in files.items() if p.startswith(prefix)]
    return match


def test_every_distinct_request_is_rendered(rendered: dict) -> None:
    assert sorted(rendered) == ["Q1", "R1", "R2", "R3", "R4"]


@pytest.mark.parametrize(
    ("request_name", "pattern"),
    [("R1", r"usage prompt (\d+)"), ("R4", r"usage input (\d+)"), ("Q1", r"usage prompt (\d+)")],
)
def test_prompt_token_count_equals_the_engines(
    manifest: dict, rendered: dict, request_name: str, pattern: str
) -> None:
    tok = default_tokenizer()
    assert len(tok.encode(rendered[request_name].text)) == _reported(manifest, request_name, pattern)


def test_every_file_text_agrees_with_our_rendering(manifest: dict, files: dict, rendered: dict) -> None:
    # Key texts are a prefix of the prompt (cold/continued saves) or the prompt plus what the model
    # generated (evict/shutdown saves). The thinking-visible key is checked on its own below.
    source = {
        "R1": "R1",
        "R2": "R2",
        "R1+R2": "R2",
        "R3": "R3",
        "R4": "R4",
        "R5": "R1",
        "Q1": "Q1",
        "Q2": "R1",
        "W1": "R1",
    }
    checked = 0
    for path, f in files.items():
        if f.entry["key_kind"] == "thinking-visible":
            continue
        ours = rendered[source[f.entry["produced_by"].split()[0]]].text_bytes
        n = min(len(ours), len(f.text))
        assert f.text[:n] == ours[:n], path
        checked += 1
    assert checked == len(manifest["files"]) - 1


def test_cold_prefix_files_hold_our_token_ids(files: dict, rendered: dict) -> None:
    tok = default_tokenizer()
    for prefix, request in (("q2/82df", "R1"), ("q2/e8dc", "R3"), ("q2/41ed", "R4"), ("q4/f961", "Q1")):
        f = _file(files, prefix)
        ours = tok.encode(rendered[request].text)
        assert f.tokens == ours[: len(f.tokens)], prefix
        assert tok.decode_bytes(f.tokens) == f.text


def test_cold_anchor_is_the_user_marker_of_our_ids(files: dict, rendered: dict) -> None:
    # §5.2.4: R3's cold file ends just before the last <｜User｜> that precedes the first <｜Assistant｜>.
    tok = default_tokenizer()
    ids = tok.encode(rendered["R3"].text)
    first_assistant = ids.index(tok.assistant_id)
    anchor = max(i for i in range(first_assistant) if ids[i] == tok.user_id)
    assert anchor == len(_file(files, "q2/e8dc").tokens) == 754


def test_evicted_sessions_start_with_our_prompt_ids(files: dict, rendered: dict) -> None:
    tok = default_tokenizer()
    for prefix, request in (("q2/d636", "R4"), ("q4/cce2", "Q1"), ("q2/bab3", "R1")):
        ours = tok.encode(rendered[request].text)
        f = _file(files, prefix)
        assert f.tokens[: len(ours)] == ours, prefix
        assert len(f.tokens) > len(ours)  # followed by the generated tokens


def test_continued_session_is_exact_prefix_plus_our_suffix_ids(
    manifest: dict, files: dict, rendered: dict
) -> None:
    # R2 reused R1's live session (prompt + 39 generated ids) and tokenized only the rest of its text.
    tok = default_tokenizer()
    r1_ids = tok.encode(rendered["R1"].text)
    session = _file(files, "q2/bab3")
    cached = _reported(manifest, "R2", r"cached (\d+)")
    live = session.tokens[:cached]
    assert live[: len(r1_ids)] == r1_ids
    r2_text = rendered["R2"].text_bytes
    live_text = tok.decode_bytes(live)
    assert r2_text.startswith(live_text)
    suffix_ids = tok.encode(r2_text[len(live_text) :].decode("utf-8"))
    assert cached + len(suffix_ids) == _reported(manifest, "R2", r"effective prompt (\d+)")
    assert session.tokens[: cached + len(suffix_ids)] == live + suffix_ids
    continued = _file(files, "q2/2b43")
    assert continued.tokens == (live + suffix_ids)[: len(continued.tokens)]


def test_disk_hit_session_is_file_ids_plus_our_suffix_ids(files: dict, rendered: dict) -> None:
    # R5 (= R1's body) loaded the 2048-token cold file, then tokenized prompt_text[text_bytes:] (§5.4).
    tok = default_tokenizer()
    cold = _file(files, "q2/82df")
    suffix_ids = tok.encode(rendered["R1"].text_bytes[len(cold.text) :].decode("utf-8"))
    expected = cold.tokens + suffix_ids
    for prefix in ("q2/f95e", "q4/f95e", "rewrite/f95e"):
        assert _file(files, prefix).tokens[: len(expected)] == expected, prefix


def test_thinking_visible_key_is_prompt_without_think_then_the_answer(files: dict, rendered: dict) -> None:
    # §5.2.3: prompt minus its trailing <think>, then </think>, the content ("OK") and EOS.
    tok = default_tokenizer()
    f = _file(files, "q2/5e22")
    prompt = rendered["R3"].text
    assert prompt.endswith(THINK_START)
    assert f.text == (prompt[: -len(THINK_START)] + THINK_END + "OK" + EOS).encode()
    ids = tok.encode(prompt)
    assert f.tokens[: len(ids)] == ids and f.tokens[len(ids) :] == [tok.think_end_id, tok.encode("OK")[0]]


def test_replayed_tool_call_is_the_sampled_block_verbatim(files: dict, rendered: dict) -> None:
    # §11.6: <｜Assistant｜><think></think> + the exact sampled block + <｜end▁of▁sentence｜>.
    block = _file(files, "q2/bab3").tool_map["call_d8061c33d951e6cd5931b05f8102e6f0"]
    assert block.startswith("\n\n<tool_calls>")
    assert f"<｜Assistant｜><think></think>{block}{EOS}" in rendered["R2"].text
