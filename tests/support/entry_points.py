"""Entry points of a third-party package, installed for one test."""

from __future__ import annotations


def install_entry_points(tmp_path, monkeypatch, groups: dict[str, dict[str, str]]) -> None:
    """A distribution on ``sys.path`` declaring ``name = "module:Class"`` in each group."""
    dist = tmp_path / "plugin_dist-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: plugin-dist\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("".join(
        f"[{group}]\n" + "".join(f"{name} = {target}\n" for name, target in entries.items())
        for group, entries in groups.items()))
    monkeypatch.syspath_prepend(str(tmp_path))
