package idemnats

import (
	"context"
	"fmt"

	"github.com/nats-io/nats.go/jetstream"
)

// Consume runs h on cons's messages (cons.Consume, with opts) until ctx
// ends or stop is called. stop stops the fetching and waits until the
// message being handled, if any, is finished (acknowledged or not); the
// messages fetched but not yet handled are dropped, and the server
// delivers them again after the consumer's AckWait (to another instance,
// or to this one once it consumes again). stop may be called more than
// once, and after ctx ended.
func Consume(ctx context.Context, cons jetstream.Consumer, h jetstream.MessageHandler, opts ...jetstream.PullConsumeOpt) (stop func(), err error) {
	cc, err := cons.Consume(h, opts...)
	if err != nil {
		return nil, fmt.Errorf("idemnats: consume: %w", err)
	}
	// Taken now, while the subscription is valid: once it is closed,
	// Closed returns a closed channel even if h is still running.
	closed := cc.Closed()
	go func() {
		select {
		case <-ctx.Done():
			cc.Stop()
		case <-closed:
		}
	}()
	return func() {
		cc.Stop()
		<-closed
	}, nil
}
