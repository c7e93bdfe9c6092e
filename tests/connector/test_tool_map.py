"""KTM entries the ds4disk connector writes for one request (ds4_vllm/connector/tool_map.py)."""

from __future__ import annotations

from pathlib import Path

from ds4_vllm.connector.tool_map import RequestToolMap
from ds4_vllm.contracts import TOOL_IDS_KEY, TOOL_MAP_KEY
from ds4_vllm.kvc import ToolMapEntry, open_checkpoint
from ds4_vllm.store.local_fs import LocalFS
from ds4_vllm.store.tool_memory import ToolMemory, new_seed, tool_call_id

OLD = '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="old">\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>'
NEW = (
    '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="a">\n</｜DSML｜invoke>\n<｜DSML｜invoke  name="b" >\n'
    '<｜DSML｜parameter name="x" string="false">  1 </｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>'
)
PROMPT = (
    "<｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜></think>ok"
    + OLD
    + "<｜end▁of▁sentence｜><｜User｜>go<｜Assistant｜><think>"
)


def test_history_and_generated_blocks_get_their_ids() -> None:
    seed = new_seed()
    params = {
        TOOL_MAP_KEY: [["call_old", OLD], ["call_gone", "<tool_calls>never sampled</tool_calls>"]],
        TOOL_IDS_KEY: {"seed": seed, "prefix": "call_"},
    }
    prompt = PROMPT.encode()
    tools = RequestToolMap(params, len(prompt))
    # a save inside the prompt: only the history block
    assert tools.entries(prompt) == [ToolMapEntry(b"call_old", OLD.encode())]
    # mid-generation, block not closed yet: no ids for it
    partial = prompt + ("plan</think>sure" + NEW[:-5]).encode()
    assert tools.entries(partial) == [ToolMapEntry(b"call_old", OLD.encode())]
    # finished: the sampled block's ids, derived exactly as the API server's tool parser derives them
    finished = prompt + ("plan</think>sure" + NEW).encode()
    ids = [tool_call_id(seed, NEW, 0), tool_call_id(seed, NEW, 1)]
    assert tools.entries(finished) == [
        ToolMapEntry(b"call_old", OLD.encode()),
        ToolMapEntry(ids[0].encode(), NEW.encode()),
        ToolMapEntry(ids[1].encode(), NEW.encode()),
    ]


def test_dsml_inside_reasoning_and_requests_without_params_get_nothing() -> None:
    prompt = PROMPT.encode()
    tools = RequestToolMap({TOOL_IDS_KEY: {"seed": new_seed()}}, len(prompt))
    assert tools.entries(prompt + ("thinking about" + NEW + "</think>done").encode()) == []
    assert RequestToolMap(None, 0).empty and RequestToolMap({"other": 1}, 0).entries(prompt) == []


def test_malformed_params_are_ignored_entry_by_entry() -> None:
    params = {
        TOOL_MAP_KEY: [
            ["x" * 300, OLD],
            ["call_ok", OLD],
            [1, OLD],
            ["call_empty", ""],
            "junk",
            ["a", "b", "c"],
        ],
        TOOL_IDS_KEY: {"seed": "not hex"},
    }
    tools = RequestToolMap(params, 0)
    assert tools.seed is None
    assert tools.entries(PROMPT.encode()) == [ToolMapEntry(b"call_ok", OLD.encode())]
    assert RequestToolMap({TOOL_MAP_KEY: 5, TOOL_IDS_KEY: []}, 0).empty


def test_written_trailer_reloads_into_a_fresh_memory(tmp_path: Path) -> None:
    """What the connector writes is what the next server's memory reads back (KTM round trip)."""
    from ds4_vllm.kvc import write_checkpoint
    from tests.store.store_helpers import header, payload, toks

    seed = new_seed()
    prompt = PROMPT.encode()
    text = prompt + ("plan</think>sure" + NEW).encode()
    entries = RequestToolMap(
        {TOOL_MAP_KEY: [["call_old", OLD]], TOOL_IDS_KEY: {"seed": seed}}, len(prompt)
    ).entries(text)
    tokens = toks(8)
    path = write_checkpoint(tmp_path, text, header(len(tokens)), payload(tokens), entries, fsync=False)
    with open_checkpoint(path) as ck:
        assert ck.header.ext_flags & 1 and list(ck.tool_map.entries) == entries
    memory = ToolMemory(checkpoints=LocalFS(tmp_path))
    assert memory.load_directory() == 3
    assert memory.lookup(tool_call_id(seed, NEW, 1)) == NEW and memory.lookup("call_old") == OLD
