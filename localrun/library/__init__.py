"""localrun's model library: a content-addressed store of models (blobs + manifests),
pulls from the Hugging Face hub, imports of local GGUF / safetensors files, Modelfiles.

It stores and describes models and runs nothing. Importing this package is cheap: gguf,
huggingface_hub and filelock load on first use. The contract, as the daemon uses it:

- `Library(root)` is the one entry point (api.py): `pull`, `create`, `resolve`, `list`, `show`,
  `copy`, `remove`, `exists`, `stored_name`, `check_files`, `has_blob`/`upload` (Ollama's
  /api/blobs), `clean_temp` and `prune` (at daemon start). Several threads and processes may
  share one store: every write lands through a locked temp file and a rename (store.py).
- `resolve(name)` gives a `ResolvedModel` (model.py): the weights (a GGUF blob, or a directory of
  a safetensors model's files), template, system prompt, parameters, messages, adapter, vision
  projector and GGUF header. It is what a backend loads; nothing else of the store is theirs.
- Errors are `localrun.errors` types with an HTTP status: `NotFound` (404) for no such model,
  `ModelDamaged` (500) for a stored model whose files are missing or damaged (naming the model and
  its repair), `InvalidRequest` (400) for bad input, `DiskFull` (507), `Cancelled` (499) for a
  pull or create its caller cancelled (nothing installed).
- The library never imports the daemon, the backends or the engine. docs/structures.md places
  it among the other parts.
"""

from localrun.library.api import Library
from localrun.library.gguf_info import GGUFInfo, read_gguf_info
from localrun.library.model import Cancelled, ModelSummary, PullEvent, ResolvedModel
from localrun.library.modelfile import Modelfile, parse_modelfile, parse_parameter
from localrun.library.names import ModelName, parse_name, validate_digest

__all__ = ["Library", "ModelName", "parse_name", "PullEvent", "ResolvedModel", "ModelSummary", "GGUFInfo",
           "read_gguf_info", "parse_modelfile", "Modelfile", "parse_parameter", "validate_digest", "Cancelled"]
