"""localrun's model library: a content-addressed store of models (blobs + manifests),
pulls from the Hugging Face hub, imports of local GGUF / safetensors files, Modelfiles.

It stores and describes models and runs nothing. See library_api.md for the contract.
Importing this package is cheap: gguf, huggingface_hub and filelock load on first use.
"""

from localrun.library.api import Library
from localrun.library.gguf_info import GGUFInfo, read_gguf_info
from localrun.library.model import Cancelled, ModelSummary, PullEvent, ResolvedModel
from localrun.library.modelfile import Modelfile, parse_modelfile, parse_parameter
from localrun.library.names import ModelName, parse_name, validate_digest

__all__ = ["Library", "ModelName", "parse_name", "PullEvent", "ResolvedModel", "ModelSummary", "GGUFInfo",
           "read_gguf_info", "parse_modelfile", "Modelfile", "parse_parameter", "validate_digest", "Cancelled"]
