"""The Hub: the token, and the upload of a finished export folder."""

from __future__ import annotations

from pathlib import Path

from pipeline.errors import InputError


def hub_token() -> str:
    """The token from HF_TOKEN or the login cache (huggingface_hub.get_token); never printed or stored."""
    import huggingface_hub

    token = huggingface_hub.get_token()
    if not token:
        raise InputError("no Hugging Face token: set HF_TOKEN or run `hf auth login`, then push again")
    return token


def push_folder(folder: Path, repo_id: str, token: str, private: bool = False) -> str:
    """create_repo + upload_folder with ``token``; returns the commit URL."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    api = HfApi(token=token)
    try:
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        commit = api.upload_folder(
            repo_id=repo_id,
            folder_path=str(folder),
            commit_message="Upload sentence encoder (pipeline export)",
        )
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else "?"
        raise InputError(
            f"Hub upload to {repo_id} failed (HTTP {status}); check the repo id and the token's rights"
        ) from None
    except (OSError, ValueError) as exc:  # connection errors; ValueError: the Hub rejected the card's YAML
        raise InputError(f"Hub upload to {repo_id} failed: {str(exc).splitlines()[0]}") from None
    return str(getattr(commit, "commit_url", None) or f"https://huggingface.co/{repo_id}")


# Licence identifiers the Hub's model-card metadata accepts (huggingface.co/docs/hub/repositories-licenses)
HUB_LICENSES = frozenset(
    """
apache-2.0 mit openrail bigscience-openrail-m creativeml-openrail-m bigscience-bloom-rail-1.0
bigcode-openrail-m
afl-3.0 artistic-2.0 bsl-1.0 bsd bsd-2-clause bsd-3-clause bsd-3-clause-clear c-uda cc cc0-1.0 cc-by-2.0
cc-by-2.5 cc-by-3.0 cc-by-4.0 cc-by-sa-3.0 cc-by-sa-4.0 cc-by-nc-2.0 cc-by-nc-3.0 cc-by-nc-4.0 cc-by-nd-4.0
cc-by-nc-nd-3.0 cc-by-nc-nd-4.0 cc-by-nc-sa-2.0 cc-by-nc-sa-3.0 cc-by-nc-sa-4.0 cdla-sharing-1.0
cdla-permissive-1.0 cdla-permissive-2.0 wtfpl ecl-2.0 epl-1.0 epl-2.0 etalab-2.0 eupl-1.1 eupl-1.2 agpl-3.0
gfdl gpl gpl-2.0 gpl-3.0 lgpl lgpl-2.1 lgpl-3.0 isc h-research intel-research lppl-1.3c ms-pl apple-ascl
apple-amlr mpl-2.0 odc-by odbl openmdw-1.0 openrail++ osl-3.0 postgresql ofl-1.1 ncsa unlicense zlib pddl
lgpl-lr deepfloyd-if-license fair-noncommercial-research-license llama2 llama3 llama3.1 llama3.2 llama3.3
llama4 gemma unknown other
""".split()
)


def check_card(text: str) -> dict:
    """The card's metadata as the Hub would read it; InputError (one line) for a card it would reject.

    Parsed with huggingface_hub's own classes (ModelCard, its ModelCardData and the model-index parser),
    offline; any warning they log while parsing is an error here.
    """
    import logging

    import yaml
    from huggingface_hub import ModelCard
    from huggingface_hub.repocard_data import model_index_to_eval_results
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    class Collect(logging.Handler):
        def __init__(self) -> None:
            super().__init__(logging.WARNING)
            self.messages: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.messages.append(record.getMessage())

    handler, hub_log = Collect(), logging.getLogger("huggingface_hub")
    hub_log.addHandler(handler)
    try:
        card = ModelCard(text, ignore_metadata_errors=False)
        metadata = card.data.to_dict()
        if "model-index" in metadata:
            model_index_to_eval_results(metadata["model-index"])
    except (ValueError, TypeError, KeyError, yaml.YAMLError) as exc:
        raise InputError(f"the model card's metadata would be rejected: {str(exc).splitlines()[0]}") from None
    finally:
        hub_log.removeHandler(handler)
    if handler.messages:
        raise InputError(
            f"the model card's metadata would be rejected: {handler.messages[0].splitlines()[0]}"
        )
    license = metadata.get("license")
    if license not in HUB_LICENSES:
        raise InputError(
            f"the model card's licence {license!r} is not a Hub licence identifier (e.g. mit, apache-2.0, "
            "other); pass --license with one"
        )
    for base in [metadata["base_model"]] if isinstance(metadata.get("base_model"), str) else (
            metadata.get("base_model") or []):  # fmt: skip
        try:
            validate_repo_id(base)
        except HFValidationError:
            raise InputError(f"the model card's base_model {base!r} is not a Hub repo id") from None
    return metadata


def dry_run(folder: Path, repo_id: str, private: bool) -> str:
    """What ``--push-to-hub`` would upload: the files with sizes and the card's metadata (no network)."""
    import yaml

    card = folder / "README.md"
    metadata = check_card(card.read_text(encoding="utf-8")) if card.is_file() else {}
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    total = sum(p.stat().st_size for p in files)
    lines = [f"dry run: would upload {len(files)} files ({total / 1e6:.1f} MB) to "
             f"{'private ' if private else ''}https://huggingface.co/{repo_id}"]  # fmt: skip
    lines += [f"  {p.stat().st_size:>12,}  {p.relative_to(folder).as_posix()}" for p in files]
    lines.append("card metadata (checked with huggingface_hub's ModelCard; the Hub would accept it):")
    lines += [
        "  " + line for line in yaml.safe_dump(metadata, allow_unicode=True, sort_keys=False).splitlines()
    ]
    return "\n".join(lines)
