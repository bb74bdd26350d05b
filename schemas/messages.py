"""The request's side of the chat wire format: messages and their parts, tools and the tool choice."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from schemas.adapters import normalize_message


class _Tolerant(BaseModel):
    # NOTE: OpenAI clients send fields we do not know (metadata, store, user, ...); tolerate them rather
    # than break a client, but never let them reach the engine.
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        # NOTE: an explicit null means "the default" to OpenAI and vLLM, and the openai client sends None as null.
        # Every optional field here defaults to what its null means; a required one stays required.
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class ImageURL(_Tolerant):
    url: str = Field(description="A data: URL (base64) of the image, or an http(s)/file URL where the server allows.")
    detail: Literal["auto", "low", "high"] = Field("auto", description="Accepted for compatibility; ignored.")


class TextPart(_Tolerant):
    type: Literal["text"]
    text: str


class ImagePart(_Tolerant):
    type: Literal["image_url"]
    image_url: ImageURL


class VideoURL(_Tolerant):
    url: str = Field(
        description="A data: URL (base64) of an MP4/WebM/QuickTime video, data:video/jpeg;base64,<frame>,<frame>,... "
        "(a list of frames), or an http(s)/file URL where the server allows."
    )


class VideoPart(_Tolerant):
    type: Literal["video_url"]
    video_url: VideoURL | None = None
    frames: list[str] | None = Field(
        None, min_length=1, description="A video as its frames (image URLs) in order: Qwen-VL's {'video': [...]}."
    )

    @model_validator(mode="after")
    def _one_source(self) -> VideoPart:
        if (self.video_url is None) == (self.frames is None):
            raise ValueError("a video part needs video_url (or, from a {'video': [...]} item, frames), not both")
        return self


class MMProcessorKwargs(_Tolerant):
    """vLLM's per-request `mm_processor_kwargs`, the video sampling ones (qwen-vl-utils' keys)."""

    fps: float | None = Field(None, gt=0.0, le=60.0, description="Frames sampled per second of video (default 2).")
    nframes: int | None = Field(None, ge=2, description="Frames sampled from each video, instead of fps.")
    min_pixels: int | None = Field(None, ge=1, description="Least pixels per sampled frame (clamped to the server's).")
    max_pixels: int | None = Field(None, ge=1, description="Most pixels per sampled frame (clamped to the server's).")
    total_pixels: int | None = Field(None, ge=1, description="Pixel budget of a video (clamped to the server's).")

    @model_validator(mode="after")
    def _fps_or_nframes(self) -> MMProcessorKwargs:
        if self.fps is not None and self.nframes is not None:
            raise ValueError("give fps or nframes, not both")
        return self


ContentPart = Annotated[TextPart | ImagePart | VideoPart, Field(discriminator="type")]


class FunctionCall(_Tolerant):
    name: str
    arguments: str = Field(description="The arguments as JSON text, as the model wrote them.")


class ToolCall(_Tolerant):
    """A call an assistant message made (the agent loop sends it back with the history)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Tolerant):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)  # an assistant's, in the agent loop's history
    tool_call_id: str | None = None  # a tool message's: the call it answers

    @model_validator(mode="before")
    @classmethod
    def _other_formats(cls, data: Any) -> Any:
        return normalize_message(data)  # Qwen-VL / MindIE items and webui inline images (schemas/adapters.py)

    @model_validator(mode="after")
    def _content_present(self) -> Message:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        if isinstance(self.content, list) and self.role != "user":
            if any(isinstance(p, ImagePart | VideoPart) for p in self.content):
                raise ValueError(f"images and videos are only accepted in user messages, not in a {self.role} message")
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"tool_calls are only accepted in assistant messages, not in a {self.role} message")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs tool_call_id, the id of the call it answers")
        return self


class FunctionDef(_Tolerant):
    name: str = Field(max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")  # OpenAI's rule for the name
    description: str | None = None
    parameters: dict[str, Any] = Field(
        default_factory=lambda: {"type": "object", "properties": {}}, description="absent: no parameters"
    )
    strict: bool = Field(False, description="Accepted; a constrained call always follows the schema.")


class Tool(_Tolerant):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Tolerant):
    name: str


class NamedToolChoice(_Tolerant):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


__all__ = [
    "ContentPart",
    "FunctionCall",
    "FunctionDef",
    "ImagePart",
    "ImageURL",
    "MMProcessorKwargs",
    "Message",
    "NamedToolChoice",
    "TextPart",
    "Tool",
    "ToolCall",
    "ToolChoice",
    "VideoPart",
    "VideoURL",
]
