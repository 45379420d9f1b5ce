"""GPT-NeoX's downloadable corpora (the names and URLs of its ``tools/datasets/corpora.py``) and their download.

``fetch_dataset(name, folder)`` downloads a corpus's files into ``folder`` (``megatron.data.download``: resumable,
verified, atomic) and unpacks archives (``.zip``, ``.tar``, ``.tar.gz``; ``megatron.data.archives``: every member
checked first, all or nothing) next to them, so that the tokenizer finds documents it reads (``.jsonl[.zst|.gz]``,
``.json[.gz]``, ``.txt``). GPT-NeoX publishes no checksums for them: each file is checked against the length its
server announces and by its format (``megatron.data.stream_check``); enwik8.zip against its known size
(36,445,475 bytes) and its unpacked text against its definition (exactly 10⁸ bytes, the first 10⁸ bytes of an
English Wikipedia dump). No SHA-256 is recorded: none is published for these URLs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from megatron.data.archives import ARCHIVE_SUFFIXES, unpack
from megatron.data.download import META_SUFFIX, RemoteFile, download_file
from megatron.errors import DataError

logger = logging.getLogger(__name__)

_EYE = "https://the-eye.eu/public/AI/pile_preliminary_components"
GPT2_VOCAB_URL = "https://s3.amazonaws.com/models.huggingface.co/bert/gpt2-vocab.json"
GPT2_MERGE_URL = "https://s3.amazonaws.com/models.huggingface.co/bert/gpt2-merges.txt"
UNPACKED_MARK = ".unpacked"


@dataclass(frozen=True)
class RemoteDataset:
    """A corpus GPT-NeoX's ``prepare_data.py`` downloads by name; ``sizes`` (by file name) checks downloaded files,
    ``unpacked_sizes`` extracted ones."""

    name: str
    urls: list[str]
    unpacked_sizes: dict[str, int] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)

    @property
    def files(self) -> list[RemoteFile]:
        return [RemoteFile(url, self.sizes.get(RemoteFile(url).filename)) for url in self.urls]


def _datasets() -> dict[str, RemoteDataset]:
    pile = "https://the-eye.eu/public/AI/pile/train"
    c4 = "https://the-eye.eu/eleuther_staging/c4"
    table = [
        RemoteDataset("enron", ["http://eaidata.bmk.sh/data/enron_emails.jsonl.zst"]),
        RemoteDataset("pile_subset", [f"{pile}/00.jsonl.zst"]),
        RemoteDataset("pile", [f"{pile}/{i:02}.jsonl.zst" for i in range(30)]),
        RemoteDataset("github", ["http://eaidata.bmk.sh/data/github_small.jsonl.zst"]),
        RemoteDataset("arxiv", [f"{_EYE}/2020-09-08-arxiv-extracts-nofallback-until-2007-068.tar.gz"]),
        RemoteDataset("europarl", [f"{_EYE}/EuroParliamentProceedings_1996_2011.jsonl.zst"]),
        RemoteDataset("freelaw", [f"{_EYE}/FreeLaw_Opinions.jsonl.zst"]),
        RemoteDataset("nih", [f"{_EYE}/NIH_ExPORTER_awarded_grant_text.jsonl.zst"]),
        RemoteDataset("pubmed", [f"{_EYE}/PMC_extracts.tar.gz"]),
        RemoteDataset("books1", [f"{_EYE}/books1.tar.gz"]),
        RemoteDataset("books3", [f"{_EYE}/books3.tar.gz"]),
        RemoteDataset("hackernews", [f"{_EYE}/hn.tar.gz"]),
        RemoteDataset(
            "openwebtext2",
            ["https://huggingface.co/datasets/segyges/OpenWebText2/resolve/main/openwebtext2.jsonl.zst.tar"],
        ),
        RemoteDataset("stackexchange", [f"{_EYE}/stackexchange_dataset.tar"]),
        RemoteDataset("ubuntu_irc", [f"{_EYE}/ubuntu_irc_until_2020_9_1.jsonl.zst"]),
        RemoteDataset("youtube_subtitles", [f"{_EYE}/yt_subs.jsonl.zst"]),
        RemoteDataset("c4", [f"{c4}/en/c4-train.{i:05}-of-01024.json.gz" for i in range(1024)]),
        RemoteDataset("c4_openwebtext", [f"{c4}/realnewslike/c4-train.{i:05}-of-00512.json.gz" for i in range(512)]),
        # enwik8.zip's size: the Hugging Face enwik8 dataset card's download_size, and the size TensorFlow-tutorial
        # style loaders check (maybe_download('enwik8.zip', 36445475)); no published SHA-256 was found
        RemoteDataset(
            "enwik8",
            ["http://mattmahoney.net/dc/enwik8.zip"],
            {"enwik8.txt": 100_000_000},
            {"enwik8.zip": 36_445_475},
        ),
    ]
    return {d.name: d for d in table}


DATASETS: dict[str, RemoteDataset] = _datasets()


def artefacts(dataset: RemoteDataset, folder: Path) -> list[Path]:
    """Everything a download of ``dataset`` leaves in ``folder`` besides the documents (``-f`` deletes them)."""
    return [
        folder / f"{remote.filename}{suffix}"
        for remote in dataset.files
        for suffix in ("", ".partial", META_SUFFIX, UNPACKED_MARK)
    ]


def download_state(name: str, folder: str | Path) -> bool | None:
    """None: no trace of a download of ``name`` in ``folder`` (its documents, if any, were put there by hand);
    True: every file downloaded and every archive unpacked; False: a download or an unpacking is unfinished."""
    dataset, folder = DATASETS[name], Path(folder)
    if not any(p.exists() for p in artefacts(dataset, folder)):
        return None
    return all(
        (folder / r.filename).is_file()
        and (not r.filename.endswith(ARCHIVE_SUFFIXES) or (folder / (r.filename + UNPACKED_MARK)).is_file())
        for r in dataset.files
    )


def fetch_dataset(name: str, folder: str | Path) -> list[Path]:
    """Download (or finish downloading) corpus ``name`` into ``folder`` and unpack its archives (each checked first,
    all or nothing, a marker written once unpacked); checks the unpacked sizes the table records; returns the files."""
    dataset = DATASETS[name]
    folder = Path(folder)
    paths = []
    for remote in dataset.files:
        path = download_file(remote, folder / remote.filename)
        mark = folder / (path.name + UNPACKED_MARK)
        if path.name.endswith(ARCHIVE_SUFFIXES) and not mark.is_file():
            logger.info("unpacking %s", path)
            unpack(path, folder)
            mark.touch()
        paths.append(path)
    for member, size in dataset.unpacked_sizes.items():
        have = (folder / member).stat().st_size if (folder / member).is_file() else None
        if have != size:
            raise DataError(
                f"{name}: {folder / member} should be {size} bytes but is {have}; delete {folder} and rerun"
            )
    return paths


def fetch_gpt2_tokenizer_files(vocab_file: str, merge_file: str) -> None:
    """GPT-NeoX's ``maybe_download_gpt2_tokenizer_data``: GPT-2's vocab and merges, when missing."""
    for url, path in ((GPT2_VOCAB_URL, vocab_file), (GPT2_MERGE_URL, merge_file)):
        download_file(RemoteFile(url), path)
