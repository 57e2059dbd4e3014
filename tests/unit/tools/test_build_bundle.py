"""What the builder takes from the repository: a commit, not uncommitted edits."""

import subprocess
import tarfile

import build_bundle


def _git(repo, *args):
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                          text=True).stdout.strip()


def test_the_bundle_takes_a_commit_not_the_working_tree(tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    (repo / "tests").mkdir(parents=True)
    (repo / "tests" / "t.py").write_text("committed\n")
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "c")
    (repo / "tests" / "t.py").write_text("edited, not committed\n")
    (repo / "tests" / "new.py").write_text("untracked\n")
    monkeypatch.setattr(build_bundle, "ROOT", repo)
    tree = tmp_path / "tree"
    sha = build_bundle.export_tree("HEAD", tree)
    assert sha == _git(repo, "rev-parse", "HEAD")
    assert (tree / "tests" / "t.py").read_text() == "committed\n"
    assert not (tree / "tests" / "new.py").exists()
    monkeypatch.setattr(build_bundle, "SOURCES", ("tests",))
    archive = build_bundle.pack_sources(tree, tmp_path)
    with tarfile.open(archive) as tar:
        assert sorted(tar.getnames()) == ["SOURCE_COMMIT", "tests", "tests/t.py"]
        assert tar.extractfile("SOURCE_COMMIT").read().decode().strip() == sha
