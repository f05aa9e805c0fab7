package idemnats

import (
	"context"
	"errors"
	"fmt"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idem-go/idem/outbox"
)

var _ outbox.Publisher = (*Publisher)(nil)

// Publisher publishes outbox events to JetStream; it implements
// outbox.Publisher. It is safe for concurrent use.
type Publisher struct {
	js jetstream.JetStream
}

// NewPublisher returns a Publisher that publishes through js.
func NewPublisher(js jetstream.JetStream) *Publisher {
	return &Publisher{js: js}
}

// Publish sends e to e.Subject with e.Body as the data and e.ID as the
// Nats-Msg-Id header, and waits for the stream's acknowledgement (bounded
// by ctx, or by js's default timeout when ctx has no deadline). An ack that
// reports a duplicate (the stream stored this id within its duplicate
// window) is success: the stream has the event. A subject no stream
// captures fails (jetstream.ErrNoStreamResponse). Errors are wrapped with %w.
func (p *Publisher) Publish(ctx context.Context, e outbox.Event) error {
	if e.ID == "" {
		return errors.New("idemnats: publish: event without an ID")
	}
	if e.Subject == "" {
		return fmt.Errorf("idemnats: publish %s: event without a subject", e.ID)
	}
	msg := nats.NewMsg(e.Subject)
	msg.Data = e.Body
	msg.Header.Set(jetstream.MsgIDHeader, e.ID)
	if _, err := p.js.PublishMsg(ctx, msg); err != nil {
		return fmt.Errorf("idemnats: publish %s to %s: %w", e.ID, e.Subject, err)
	}
	return nil
}
