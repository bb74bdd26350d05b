"""Ask the running server about an image:
python -m demo.chat demo/shapes.png "Where is the white star?" --draw boxes.png
(--draw: the answer's grounding boxes drawn on the image)."""

from __future__ import annotations

import argparse
import base64
import mimetypes

from openai import OpenAI


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("image", help="path to a PNG, JPEG, WEBP, GIF or BMP file")
    parser.add_argument("question", nargs="?", default="What is in the picture?")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (the API's default is 1)")
    parser.add_argument("--draw", metavar="PNG", help="write the image with the answer's boxes drawn on it")
    args = parser.parse_args()

    mime = mimetypes.guess_type(args.image)[0] or "image/png"
    with open(args.image, "rb") as f:
        url = f"data:{mime};base64,{base64.b64encode(f.read()).decode()}"
    client = OpenAI(base_url=args.base_url, api_key="unused")
    model = client.models.list().data[0].id
    stream = client.chat.completions.create(
        model=model,
        messages=[
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": args.question}],
            }
        ],
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        stream=True,
        stream_options={"include_usage": True},
    )
    boxes = []
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
        if chunk.choices and (extra := chunk.choices[0].delta.model_extra or {}).get("boxes"):
            boxes += extra["boxes"]  # our extension: the finish chunk carries the answer's boxes, in pixels
        if chunk.usage:
            print(f"\n[{chunk.usage.prompt_tokens} prompt + {chunk.usage.completion_tokens} completion tokens]")
    for box in boxes:
        print(f"box: {box['label'] or '(no label)'} at ({box['x1']}, {box['y1']})-({box['x2']}, {box['y2']}) px")
    if args.draw:
        from PIL import Image

        from demo.draw import draw_boxes

        draw_boxes(Image.open(args.image), boxes).save(args.draw)
        print(f"drawn: {args.draw}")


if __name__ == "__main__":
    main()
