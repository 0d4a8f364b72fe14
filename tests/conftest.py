import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(2)

from moespec.engine import Engine  # noqa: E402

_engines: list[Engine] = []


@pytest.fixture(autouse=True)
def no_leaked_pages(monkeypatch):
    """After every test, every engine it built has finished its requests and every KV page is free or
    cached (a cached page nobody uses counts as free)."""
    created = []
    original = Engine.__init__

    def tracking_init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        created.append(self)

    monkeypatch.setattr(Engine, "__init__", tracking_init)
    yield created
    for engine in created:
        assert not engine.has_unfinished(), "requests left unfinished"
        assert engine.allocator.num_free == engine.allocator.num_pages, (
            f"{engine.allocator.num_pages - engine.allocator.num_free} KV pages leaked")
        assert not any(engine.allocator.refs), "KV pages still referenced (free or cached is all an idle page can be)"
