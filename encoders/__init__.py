"""The encoder replicas' model code: images in, projected embeddings out; the families, their preprocessing and
token counts (which the ingress and the LLM replica use too), and `ModelSpec`, the checkpoint's facts, worked out
once per process from its config and its family here. No Ray: the Serve deployment that runs the encoder is
`deployments.encoder.server:Encoder`."""

from encoders.cache import EmbeddingLRU
from encoders.cost import VisionCost
from encoders.family import Family, ImageProcessing, ImageTokens, VisionEncoder
from encoders.images import FORMATS, ImageInfo, data_url_format, decode_data_url, image_size, load_rgb, probe_image
from encoders.llava import LlavaVisionEncoder
from encoders.llava_next import LlavaNextImageProcessing, LlavaNextVisionEncoder
from encoders.llava_processing import LlavaImageProcessing
from encoders.model_spec import ModelSpec
from encoders.qwen2_5_vl import Qwen2_5_VLVisionEncoder
from encoders.qwen2_vl import Qwen2VLImageProcessing, Qwen2VLVisionEncoder, smart_resize
from encoders.registry import FAMILIES, family_for, family_of, image_tokens_of
from encoders.runner import EncoderRunner, ImageBatcher, Preprocessed

__all__ = [
    "FAMILIES",
    "EmbeddingLRU",
    "EncoderRunner",
    "FORMATS",
    "Family",
    "ImageBatcher",
    "ImageInfo",
    "ImageProcessing",
    "ImageTokens",
    "LlavaImageProcessing",
    "LlavaNextImageProcessing",
    "LlavaNextVisionEncoder",
    "LlavaVisionEncoder",
    "ModelSpec",
    "Preprocessed",
    "Qwen2_5_VLVisionEncoder",
    "Qwen2VLImageProcessing",
    "Qwen2VLVisionEncoder",
    "VisionCost",
    "VisionEncoder",
    "data_url_format",
    "decode_data_url",
    "family_for",
    "family_of",
    "image_tokens_of",
    "image_size",
    "load_rgb",
    "probe_image",
    "smart_resize",
]
