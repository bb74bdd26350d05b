"""The video decoding process (run as a script by encoders/video_decode.py, never imported): limits itself, then
decodes a container's sampled frames with PyAV and resizes each with PIL's bicubic, as the image path resizes.

stdin: one JSON line {"indices": [...], "width": w, "height": h, "memory_mib": m}, then the container's bytes.
stdout: the frames, len(indices) x height x width x 3 bytes (RGB), in the order of `indices`.
Exit 0, or 2 with one line on stderr saying why the video could not be decoded. A crash (ffmpeg has a long CVE
list) or a limit ends this process alone; the encoder replica answers that request with a 400."""

import io
import json
import resource
import sys


def main() -> int:
    header = json.loads(sys.stdin.buffer.readline())
    limit = int(header["memory_mib"]) << 20
    # First, before ffmpeg is loaded: address space (ffmpeg's allocations fail: an error, not the host's OOM
    # killer), no core dumps.
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    import av
    from PIL import Image

    data = sys.stdin.buffer.read()
    indices, size = header["indices"], (int(header["width"]), int(header["height"]))
    wanted: dict[int, int] = {}
    for i in indices:  # NOTE: an index may repeat (a frame list's padding, a rounding tie)
        wanted[i] = wanted.get(i, 0) + 1
    last, out, decoded = max(indices), sys.stdout.buffer, 0
    try:
        with av.open(io.BytesIO(data), mode="r", metadata_errors="ignore") as container:
            stream = container.streams.video[0]
            stream.thread_count = 1  # NOTE: one thread: a bounded, predictable address space
            for frame in container.decode(stream):
                if decoded in wanted:
                    image = frame.to_image()  # RGB, converted by FFmpeg's swscale
                    if image.size != size:
                        image = image.resize(size, resample=Image.Resampling.BICUBIC)
                    out.write(image.tobytes() * wanted[decoded])
                decoded += 1
                if decoded > last:
                    break
    except (av.FFmpegError, MemoryError, ValueError) as e:
        print(f"frame {decoded} could not be decoded ({type(e).__name__})", file=sys.stderr)
        return 2
    if decoded <= last:  # NOTE: a half-decodable video is refused, never served as a shorter one
        print(f"only {decoded} frames could be decoded; frame {last} was sampled", file=sys.stderr)
        return 2
    out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
