"""The run's message journal (``contract_lib.wire.journal``): records in order, nothing read
twice, a dead writer's torn record dropped, and a full journal handing over to the pipe
without losing or reordering a message."""

from __future__ import annotations

import os
import pickle

import pytest

import contract_lib
from contract_lib.wire import journal


@pytest.mark.fast
def test_records_are_read_in_order_up_to_each_note_and_once():
    with journal.created() as fd:
        writer, reader = journal.Writer(fd), journal.Reader(fd)
        messages = [("row", "steps", {"step": step}) for step in range(5)]
        for message in messages[:3]:
            assert writer.append(pickle.dumps(message))
        noted = writer.offset
        for message in messages[3:]:
            assert writer.append(pickle.dumps(message))
        assert reader.read(noted) == messages[:3]  # a note covers what was stored before it
        assert reader.read(noted) == []
        assert reader.read() == messages[3:]  # the writer is gone: every whole record
        reader.close()


@pytest.mark.fast
def test_a_record_its_writer_died_in_is_not_read():
    with journal.created() as fd:
        writer, reader = journal.Writer(fd), journal.Reader(fd)
        assert writer.append(pickle.dumps("whole"))
        start = writer.offset
        data = pickle.dumps("cut short")
        with open(fd, "r+b", closefd=False) as raw:  # the bytes, not yet their length
            raw.seek(start + 4)
            raw.write(data)
        assert reader.read() == ["whole"]
        with open(fd, "r+b", closefd=False) as raw:  # a length over garbage bytes
            raw.seek(start)
            raw.write((len(data)).to_bytes(4, "little"))
            raw.seek(start + 4)
            raw.write(b"\xff" * len(data))
        assert reader.read() == []
        reader.close()


@pytest.mark.fast
def test_a_full_journal_refuses_the_record(monkeypatch):
    monkeypatch.setattr(journal, "SIZE", 64)
    with journal.created() as fd:
        assert os.fstat(fd).st_size == 64
        writer = journal.Writer(fd)
        assert writer.append(b"x" * 40)
        assert not writer.append(b"y" * 40)  # the run's messages go on the pipe from here
        assert writer.offset == 48  # the stored record, aligned; nothing of the refused one


def test_a_run_whose_journal_fills_loses_nothing(monkeypatch):
    """The same frames as a run whose journal holds everything: the records stored before
    the journal filled come first, then the pipe's, in the order they were taken."""
    whole = contract_lib.run("two-turn", "mlx", cache=False)
    monkeypatch.setattr(journal, "SIZE", 16 << 10)  # fills after a few steps
    spilled = contract_lib.run("two-turn", "mlx", cache=False)
    assert spilled.status == whole.status == "finished"
    expected, got = whole.comparable(), spilled.comparable()
    assert list(got) == list(expected)
    for name, table in expected.items():
        assert table.equals(got[name]), name
