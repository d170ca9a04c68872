"""A recording stand-in for the Hub client (the Hub is unreachable here): every step of a push up to HfApi's calls
is the real code. Kept apart from helpers.py because launched processes import it from a sitecustomize module,
before anything else."""

import json
import os
from pathlib import Path

import yaml

TOKEN = "hf_secret_test_token"


class RecordingHub:
    """huggingface_hub.HfApi as the push uses it: whoami answers `answer` (a write token of user `someone`, or an
    error); whoami, create_repo and upload_folder (with the file filter the real one applies) are appended with the
    process's rank to the JSON-lines file $HUB_CALLS, which launched processes share."""

    answer = {"name": "someone", "auth": {"accessToken": {"role": "write"}}}

    def __init__(self, token=None):
        self.token = token

    def _record(self, *call):
        with open(os.environ["HUB_CALLS"], "a") as handle:
            handle.write(json.dumps({"rank": int(os.environ.get("RANK", "0")), "call": call}) + "\n")

    def whoami(self):
        self._record("whoami", self.token)
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer

    def create_repo(self, repo_id, private=None, exist_ok=False, repo_type=None):
        self._record("create_repo", repo_id, private, exist_ok)
        return f"https://huggingface.co/{repo_id}"

    def upload_folder(self, repo_id, folder_path, commit_message=None, ignore_patterns=None, repo_type=None):
        from huggingface_hub.utils import filter_repo_objects

        files = sorted(str(p.relative_to(folder_path)) for p in Path(folder_path).rglob("*") if p.is_file())
        self._record("upload_folder", repo_id, sorted(filter_repo_objects(files, ignore_patterns=ignore_patterns)),
                     commit_message)
        return f"https://huggingface.co/{repo_id}/commit/0123abc"


def recorded(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def use_recording_hub(tmp_path, monkeypatch) -> Path:
    """The recording stand-in in place of the Hub client; no token of this machine's user counts. Returns the
    file the calls are recorded in."""
    from hf_linear_attn.training import hub as hub_module

    calls = tmp_path / "hub_calls.jsonl"
    monkeypatch.setenv("HUB_CALLS", str(calls))
    monkeypatch.setattr(hub_module, "HfApi", RecordingHub)
    monkeypatch.setattr(hub_module, "get_token", lambda: None)
    return calls


def front_matter(card_path: Path) -> dict:
    """The README's YAML header, parsed by a plain YAML reader (what the Hub reads)."""
    text = card_path.read_text()
    assert text.startswith("---\n")
    return yaml.safe_load(text.split("---\n")[1])
