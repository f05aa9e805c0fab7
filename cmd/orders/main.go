// Command orders runs the order service and its operator tools; see
// `orders --help`.
package main

import (
	"context"
	"os"
	"os/signal"
	"syscall"

	"github.com/idem-go/idem/cmd/internal/ordersapp"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := (&ordersapp.App{}).Run(ctx, os.Args[1:])
	stop()
	os.Exit(code)
}
