import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(2)

from moespec.engine import Engine  # noqa: E402

_engines: list[Engine] = []


@pytest.fixture(scope="session")
def deepseek_mtp(tmp_path_factory):
    """A random tiny DeepSeek-V3 with an MTP layer (vocab 120, 128 positions)."""
    from tiny_models import save_tiny_deepseek
    path = tmp_path_factory.mktemp("ds-mtp")
    save_tiny_deepseek(path, mtp=True)
    return str(path)


@pytest.fixture(scope="session")
def llama_pair(tmp_path_factory):
    """A random tiny Llama target and a smaller draft with the same vocabulary."""
    from tiny_models import save_tiny_llama
    target, draft = tmp_path_factory.mktemp("target"), tmp_path_factory.mktemp("draft")
    save_tiny_llama(target)
    save_tiny_llama(draft, seed=1, layers=1, hidden=32)
    return str(target), str(draft)


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


_file_seconds: dict[str, float] = {}


def pytest_runtest_logreport(report):
    """Seconds per test file (setup, call and teardown), for the summary below."""
    name = report.nodeid.split("::", 1)[0]
    _file_seconds[name] = _file_seconds.get(name, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    """Where the suite's time goes, per file: the default suite is kept under ~12 minutes on 2 cores."""
    if not _file_seconds:
        return
    ranked = sorted(_file_seconds.items(), key=lambda item: -item[1])
    terminalreporter.write_sep("=", f"seconds per test file ({sum(_file_seconds.values()):.0f} s in all)")
    for name, seconds in ranked[:20]:
        terminalreporter.write_line(f"{seconds:8.1f}  {name}")
