// Package idemnats connects the idem protocol to NATS JetStream, at both
// ends of an event's trip:
//
//   - Publisher hands outbox events to JetStream with the event's id as the
//     Nats-Msg-Id header and returns only once the stream has acknowledged
//     the message. JetStream drops a repeat of an id within the stream's
//     duplicate window, so an outbox relay that publishes an event again
//     (it crashed before marking it sent) adds nothing to the stream.
//   - EnsureStream creates the stream with a duplicate window, or brings an
//     existing one to the asked configuration; every process may call it at
//     start.
//   - Handler makes a JetStream consumer apply each message once: it runs
//     the message through idem.Do under the message's id, so a redelivery
//     (the consumer died after its commit, before the ack) or a repeat
//     published after the duplicate window replays the stored result instead
//     of running the function again, and it acknowledges a message only
//     after the function's transaction has committed.
//
// Between the two, the guarantee is: every event added to the outbox is
// applied exactly once by each consumer, though it may be published, stored
// in the stream and delivered more than once.
package idemnats
