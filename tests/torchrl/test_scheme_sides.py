"""A scheme's two sides: what of each crosses a pickle, and what starts afresh."""

import pickle

from shmsync.torchrl.scheme_sides import ReceiverSide, SenderSide


def test_a_sender_side_sends_only_its_remote_kind_and_upstream():
    side = SenderSide("distributed", ("127.0.0.1", 29500))
    side.awaiting_collector = True
    sent = pickle.loads(pickle.dumps(side))
    assert (sent.remote_kind, sent.upstream) == ("distributed", ("127.0.0.1", 29500))
    assert (sent.group, sent.publisher, sent.awaiting_collector, len(sent.remote_rows)) == (None, None, False, 0)


def test_a_receiver_side_sends_what_a_worker_needs_and_never_its_receiver():
    side = ReceiverSide(["a", "b"], 4, True)
    side.receiver = object()  # type: ignore[assignment]
    sent = side.sent()
    assert (sent.store_names, sent.expected_readers, sent.runs_sent_weights_next) == (["a", "b"], 4, True)
    assert sent.receiver is None and side.receiver is not None
