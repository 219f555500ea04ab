"""A stand-in ``wandb`` module that records what jagg asks of it (init, define_metric, log, Image, Video, finish), so the
wandb logging is tested whether or not the real package is installed."""

from __future__ import annotations

import sys
import types


class Image:
    def __init__(self, path, caption=None):
        self.path, self.caption = path, caption


class Video(Image):
    pass


class Run:
    def __init__(self, calls: list, kwargs: dict):
        self.calls, self.id = calls, kwargs["id"]
        calls.append(("init", kwargs))

    def define_metric(self, name, **kw):
        self.calls.append(("define_metric", name, kw))

    def log(self, data: dict):
        self.calls.append(("log", data))

    def finish(self):
        self.calls.append(("finish",))


def install(monkeypatch) -> list:
    """Put the stand-in into ``sys.modules["wandb"]`` for one test; returns the list its calls are appended to."""
    calls: list = []
    module = types.ModuleType("wandb")
    module.init = lambda **kwargs: Run(calls, kwargs)
    module.Image = Image
    module.Video = Video
    monkeypatch.setitem(sys.modules, "wandb", module)
    return calls


def sessions(calls: list) -> list[list]:
    """``calls`` split at each ``init``: one list per wandb session (a run, then each resume)."""
    out: list[list] = []
    for call in calls:
        if call[0] == "init":
            out.append([])
        out[-1].append(call)
    return out
