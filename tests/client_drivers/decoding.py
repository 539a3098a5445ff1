"""The samples a player gets from encoded audio (PyAV, as the clients' own decoders): for the drivers
whose client hands back a file's bytes."""

import io

import av


def decoded_samples(data: bytes) -> tuple[int, int]:
    """(samples per channel, rate) of an audio file's bytes, decoded whole."""
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.audio[0]
        samples = sum(frame.samples for frame in container.decode(stream))
        return samples, stream.codec_context.sample_rate
