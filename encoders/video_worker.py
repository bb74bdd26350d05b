"""The video process (run as a script by encoders/video_decode.py, never imported): limits itself, then either probes a
container (what the ingress plans with) or decodes its sampled frames with PyAV and resizes each with PIL's bicubic,
as the image path resizes.

stdin: one JSON line, then the container's bytes.
- {"probe": true, "max_packets": n, "memory_mib": m}: stdout is one JSON object, the container's facts (format,
  duration, and the first video stream's codec, size, rate, header frame count, duration and packets demuxed, up to
  n + 1); encoders/videos.py checks them against the limits. No frame is decoded here beyond what FFmpeg's stream
  probing decodes to learn a stream's parameters.
- {"indices": [...], "width": w, "height": h, "memory_mib": m}: stdout is the frames, len(indices) x height x width x
  3 bytes (RGB), in the order of `indices`.
Exit 0, or 2 with one line on stderr saying why the video could not be read. A crash (ffmpeg has a long CVE list),
a demuxer's runaway allocation (an MP4 whose tables claim 100 million samples in 3 KB) or a limit ends this process
alone; the replica that started it answers that request with a 400."""

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

    data = sys.stdin.buffer.read()
    if header.get("probe"):
        return probe(av, data, int(header["max_packets"]))
    return decode(av, data, header)


def probe(av, data: bytes, max_packets: int) -> int:
    try:
        with av.open(io.BytesIO(data), mode="r", metadata_errors="ignore") as container:
            facts = {"format": container.format.name, "duration": container.duration, "video": None}
            if container.streams.video:
                stream = container.streams.video[0]
                ctx, rate = stream.codec_context, stream.average_rate or stream.guessed_rate
                timed = stream.duration is not None and stream.time_base is not None
                facts["video"] = {
                    "codec": ctx.codec.canonical_name,  # the codec (av1), not its decoder (libdav1d)
                    "width": ctx.width,
                    "height": ctx.height,
                    "fps": float(rate) if rate else 0.0,
                    "frames": stream.frames,  # the header's count, 0 when the container has none
                    "duration_s": float(stream.duration * stream.time_base) if timed else None,
                    "packets": count_packets(container, stream, max_packets),
                }
    except (av.FFmpegError, MemoryError, ValueError) as e:
        print(type(e).__name__, file=sys.stderr)
        return 2
    sys.stdout.write(json.dumps(facts))
    return 0


def count_packets(container, stream, limit: int) -> int:
    """Frames = the stream's packets (demuxed, not decoded), counted up to one past `limit`."""
    n = 0
    for packet in container.demux(stream):
        n += packet.size > 0  # the demuxer ends each stream with an empty packet
        if n > limit:
            break
    return n


def decode(av, data: bytes, header: dict) -> int:
    from PIL import Image

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
