"""Where a checkpoint's tensors come from: a directory of safetensors shards, or a state dict.

Why a layer of its own: `fp4_dispatch.load_checkpoint` validates a whole checkpoint
before it changes the model, and must do so without reading the weights (peak host
memory about one shard). A safetensors header holds every tensor's dtype and shape, so
`TensorInfo` for a whole checkpoint costs a few kilobytes read per shard; the data is
read later, one shard open at a time (`Source.read_files`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

__all__ = [
    "STATE_DICT",
    "CheckpointError",
    "DirectorySource",
    "Source",
    "StateDictSource",
    "TensorInfo",
    "open_source",
]

#: the "file" a state dict's tensors come from, in messages
STATE_DICT = "<state dict>"
INDEX_FILE = "model.safetensors.index.json"

#: safetensors header dtype names -> torch dtypes (the ones a checkpoint of ours holds;
#: an unlisted name maps to None and is reported if a quantized tensor has it)
_DTYPES: dict[str, torch.dtype] = {
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


class CheckpointError(ValueError):
    """A checkpoint `load_checkpoint` cannot load; the message names the tensor (or
    config entry) and the file. Raised before the model is changed."""


@dataclass(frozen=True)
class TensorInfo:
    """A tensor's file, dtype (None: a dtype this module does not name) and shape."""

    file: str
    dtype: torch.dtype | None
    shape: tuple[int, ...]
    dtype_name: str


class Source:
    """Tensors by name: their `TensorInfo` up front, their data per file on demand."""

    label: str
    #: True when tensors read are views of memory-mapped files (safetensors on the CPU)
    maps_files: bool = False
    #: config.json and hf_quant_config.json contents where the source has them
    config: dict
    quant_config: dict | None

    def infos(self) -> dict[str, TensorInfo]:
        raise NotImplementedError

    def read_files(
        self, names: set[str]
    ) -> Iterator[tuple[str, Iterator[tuple[str, torch.Tensor]]]]:
        """For each file holding some of `names`: (file, its (name, CPU tensor) pairs),
        one file open at a time."""
        raise NotImplementedError

    def read_small(self, name: str) -> torch.Tensor:
        """One (small) tensor's data, e.g. a global scale checked before loading."""
        raise NotImplementedError


class StateDictSource(Source):
    """A ``{name: tensor}`` mapping (already in memory)."""

    def __init__(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        self.label = STATE_DICT
        self.config, self.quant_config = {}, None
        bad = [k for k, v in state_dict.items() if not isinstance(v, torch.Tensor)]
        if bad:
            raise CheckpointError(
                f"source: {bad[0]!r} in {STATE_DICT}: expected a torch.Tensor, "
                f"got {type(state_dict[bad[0]]).__name__}"
            )
        self._sd = state_dict

    def infos(self) -> dict[str, TensorInfo]:
        return {
            k: TensorInfo(STATE_DICT, v.dtype, tuple(v.shape), str(v.dtype).split(".")[-1])
            for k, v in self._sd.items()
        }

    def read_files(self, names: set[str]):
        yield STATE_DICT, ((k, self._sd[k]) for k in self._sd if k in names)

    def read_small(self, name: str) -> torch.Tensor:
        return self._sd[name]


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path.name} in {path.parent}: not readable JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{path.name} in {path.parent}: expected a JSON object")
    return data


class DirectorySource(Source):
    """A Hugging Face style directory: ``config.json``, optional ``hf_quant_config.json``,
    ``*.safetensors`` shards and their ``model.safetensors.index.json`` (when there is
    one, it lists the shards; otherwise every ``*.safetensors`` file is one)."""

    def __init__(self, path: Path) -> None:
        from safetensors import safe_open  # noqa: PLC0415 - optional: the [hf] extra

        self._open = safe_open
        self.maps_files = True
        self.path = path
        self.label = str(path)
        cfg = path / "config.json"
        self.config = _read_json(cfg) if cfg.is_file() else {}
        hq = path / "hf_quant_config.json"
        self.quant_config = _read_json(hq) if hq.is_file() else None
        self._files = self._shards()
        self._infos = self._headers()

    def _shards(self) -> list[Path]:
        index = self.path / INDEX_FILE
        if index.is_file():
            weight_map = _read_json(index).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise CheckpointError(f"{INDEX_FILE} in {self.path}: no 'weight_map' object")
            self._index = weight_map
            names = sorted(set(weight_map.values()))
            missing = [n for n in names if not (self.path / n).is_file()]
            if missing:
                raise CheckpointError(
                    f"{missing[0]} in {self.path}: listed in {INDEX_FILE} but not there"
                )
            return [self.path / n for n in names]
        self._index = None
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"source: no *.safetensors file in {self.path}")
        return files

    def _headers(self) -> dict[str, TensorInfo]:
        infos: dict[str, TensorInfo] = {}
        for f in self._files:
            try:
                with self._open(str(f), framework="pt") as st:
                    for name in st.keys():  # noqa: SIM118 - a safetensors handle, not a dict
                        sl = st.get_slice(name)
                        dname = sl.get_dtype()
                        if name in infos:
                            raise CheckpointError(
                                f"{name} in {f.name}: also in {infos[name].file} (two shards)"
                            )
                        infos[name] = TensorInfo(
                            f.name, _DTYPES.get(dname), tuple(sl.get_shape()), dname
                        )
            except CheckpointError:
                raise
            except Exception as exc:  # safetensors raises its own SafetensorError
                raise CheckpointError(
                    f"{f.name} in {self.path}: not a readable safetensors file ({exc})"
                ) from exc
        if self._index is not None:
            for name, file in self._index.items():
                info = infos.get(name)
                if info is None or info.file != file:
                    raise CheckpointError(
                        f"{name} in {file}: listed in {INDEX_FILE}, not in that shard"
                    )
        return infos

    def infos(self) -> dict[str, TensorInfo]:
        return self._infos

    def read_files(self, names: set[str]):
        for f in self._files:
            wanted = [n for n, i in self._infos.items() if i.file == f.name and n in names]
            if wanted:
                yield f.name, self._read(f, wanted)

    def _read(self, f: Path, wanted: list[str]):
        """The tensors of one shard, the file mapped once per tensor: safetensors maps the
        whole file, and every page read stays resident while the mapping lives, so one
        long-lived mapping would hold a whole shard; this one holds one tensor (measured:
        benchmarks/RESULTS.md, "Loading checkpoints")."""
        for name in wanted:
            with self._open(str(f), framework="pt") as st:
                t = st.get_tensor(name)
            yield name, t
            del t  # the caller has its copy: the mapping goes with the last view

    def read_small(self, name: str) -> torch.Tensor:
        with self._open(str(self.path / self._infos[name].file), framework="pt") as st:
            return st.get_tensor(name)


def open_source(source: object) -> Source:
    """A `Source` for a directory path (str or os.PathLike) or a state dict."""
    if isinstance(source, Mapping):
        return StateDictSource(source)
    if isinstance(source, (str, Path)) or hasattr(source, "__fspath__"):
        path = Path(source)
        if not path.is_dir():
            raise CheckpointError(
                f"source: expected a checkpoint directory or a state dict, got {str(path)!r} "
                "(not a directory)"
            )
        return DirectorySource(path)
    raise TypeError(
        f"source: expected a directory path or a state dict, got {type(source).__name__}"
    )
