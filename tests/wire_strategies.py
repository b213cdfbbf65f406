"""Hypothesis strategies for valid wire messages."""

from __future__ import annotations

from hypothesis import strategies as st

from omniwire import wire

names = st.text(
    alphabet=st.characters(codec="utf-8", categories=("L", "N", "P")), min_size=1, max_size=16
)
u64 = st.integers(0, 2**64 - 1)
small = st.integers(0, 2**20)
texts = st.text(max_size=40)


@st.composite
def tensor_tables(draw: st.DrawFn, max_tensors: int = 4) -> tuple[tuple[wire.TensorMeta, ...], int]:
    """A packed tensor table and the buffer length it needs."""
    metas = []
    end = 0
    for _ in range(draw(st.integers(0, max_tensors))):
        dtype = draw(st.sampled_from(sorted(wire.DTYPE_ITEMSIZE)))
        shape = tuple(draw(st.lists(st.integers(0, 6), max_size=3)))
        nbytes = wire.DTYPE_ITEMSIZE[dtype]
        for d in shape:
            nbytes *= d
        offset = wire.align_up(end) + 64 * draw(st.integers(0, 2))
        metas.append(
            wire.TensorMeta(
                dtype=dtype, shape=shape, offset=offset, nbytes=nbytes, path=draw(texts)
            )
        )
        end = offset + nbytes
    return tuple(metas), end


@st.composite
def data_refs(draw: st.DrawFn) -> wire.DataRef:
    metas, end = draw(tensor_tables())
    backend = draw(names)
    length = end + draw(st.integers(0, 4096))
    return wire.DataRef(
        object_id=draw(u64),
        kind=draw(st.sampled_from(["payload", "stream_chunk"])),
        backend=backend,
        layout="packed",
        ref=wire.BackendRef(backend=backend, info=draw(st.binary(max_size=32)), length=length),
        header=draw(st.binary(max_size=64)),
        tensors=metas,
        ready=draw(st.none() | st.integers(0, length)),
    )


@st.composite
def inline_chunks(draw: st.DrawFn) -> wire.InlineStreamChunkRef:
    metas, end = draw(tensor_tables())
    return wire.InlineStreamChunkRef(
        header=draw(st.binary(max_size=32)),
        tensors=metas,
        data=bytes(end),
        kind=draw(st.sampled_from(["stream_chunk", "payload"])),
    )


hellos = st.builds(
    wire.HelloMessage,
    endpoint=names,
    wire_min=st.just((1, 0)),
    wire_max=st.tuples(st.just(1), st.integers(0, 255)),
    features=st.lists(names, max_size=3).map(tuple),
    host_id=names,
    hostname=texts,
    pid=st.integers(0, 2**31),
    process_token=names,
    instance=u64,
    address=names,
    abort_address=texts,
    devices=st.lists(
        st.builds(wire.DeviceInfo, kind=st.sampled_from(["cpu", "cuda"]), index=small, uuid=texts),
        max_size=3,
    ).map(tuple),
    backends=st.lists(
        st.builds(wire.BackendInfo, name=names, info=st.binary(max_size=32)), max_size=3
    ).map(tuple),
    is_reply=st.booleans(),
    to_endpoint=st.just("") | names,
)


@st.composite
def data_readies(draw: st.DrawFn) -> wire.DataReadyMessage:
    which = draw(st.sampled_from(["ref", "inline", "done", "error"]))
    return wire.DataReadyMessage(
        request_id=draw(names),
        from_stage=draw(names),
        to_stage=draw(names),
        chunk_id=draw(u64),
        data_ref=draw(data_refs()) if which == "ref" else None,
        inline=draw(inline_chunks()) if which == "inline" else None,
        is_done=which == "done" or draw(st.booleans()),
        error=draw(texts) if which == "error" else None,
        metadata=draw(st.binary(max_size=16)),
        traceparent=draw(st.just("") | texts),
    )


progresses = st.builds(
    wire.DataProgressMessage, object_id=u64, from_stage=names, to_stage=names, ready=u64
)
nack_reasons = st.sampled_from(sorted(wire.NACK_REASONS)) | names  # unknown codes are legal
acks = st.builds(
    wire.DataAckMessage,
    object_id=u64,
    from_stage=names,
    to_stage=names,
    success=st.just(True),
    error=st.none(),
) | st.builds(
    wire.DataAckMessage,
    object_id=u64,
    from_stage=names,
    to_stage=names,
    success=st.just(False),
    error=st.none() | texts,
    reason=st.none() | nack_reasons,
)
aborts = st.builds(
    wire.AbortMessage,
    request_id=names,
    from_stage=names,
    reason=texts,
    origin=st.just("") | names,
)
goodbyes = st.builds(wire.GoodbyeMessage, from_stage=names, instance=u64, reason=texts)
refusals = st.builds(
    wire.RefusalMessage,
    from_stage=names,
    to_stage=st.just("") | names,
    code=st.sampled_from(sorted(wire.REFUSAL_CODES)) | names,
    detail=texts,
    addressed=st.just("") | names,
)
batchable = st.one_of(data_readies(), progresses, acks, aborts)
batches = st.builds(
    wire.BatchMessage, messages=st.lists(batchable, min_size=1, max_size=4).map(tuple)
)

messages = st.one_of(hellos, data_readies(), progresses, acks, aborts, goodbyes, refusals, batches)
