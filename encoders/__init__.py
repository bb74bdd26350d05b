"""Images: loading and limits, per-family preprocessing, and the ViT + projector encoders."""

from encoders.images import FORMATS, ImageInfo, decode_data_url, load_rgb, probe_image
from encoders.qwen2_vl import Qwen2VLImageProcessing, Qwen2VLVisionEncoder, smart_resize
from encoders.registry import FAMILIES, Family, ImageProcessing, VisionEncoder, family_of

__all__ = [
    "FAMILIES",
    "FORMATS",
    "Family",
    "ImageInfo",
    "ImageProcessing",
    "Qwen2VLImageProcessing",
    "Qwen2VLVisionEncoder",
    "VisionEncoder",
    "decode_data_url",
    "family_of",
    "load_rgb",
    "probe_image",
    "smart_resize",
]
