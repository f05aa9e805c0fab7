package natsembed

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
)

// tokenBytes is the size of a token LoadOrCreateToken makes: 32 random
// bytes, 64 hex characters.
const tokenBytes = 32

// ErrNoToken is matched (errors.Is) by ReadToken's error when the file
// does not exist.
var ErrNoToken = errors.New("natsembed: no token file")

// LoadOrCreateToken returns the token kept in the file at path, creating
// the file (mode 0600, readable by its owner only) with a new random
// token when it does not exist: the first start of a server makes the
// token, and every later start, and every client, reads the same one.
// Several processes may call it at once: the file is written whole under
// a temporary name and linked into place only if no other process did so
// first, and then every caller returns the token of the file that won.
// The directory of path must exist.
//
// A file that other users may read or write (any permission bit for the
// group or others) is refused: its token may be known to them.
func LoadOrCreateToken(path string) (string, error) {
	tok, err := ReadToken(path)
	if !errors.Is(err, ErrNoToken) {
		return tok, err
	}
	b := make([]byte, tokenBytes)
	if _, err := rand.Read(b); err != nil {
		return "", fmt.Errorf("natsembed: token: %w", err)
	}
	tok = hex.EncodeToString(b)
	tmp, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+"-*")
	if err != nil {
		return "", fmt.Errorf("natsembed: writing the token file: %w", err)
	}
	defer os.Remove(tmp.Name())
	if err := tmp.Chmod(0o600); err != nil {
		tmp.Close()
		return "", fmt.Errorf("natsembed: writing the token file: %w", err)
	}
	if _, err := tmp.WriteString(tok + "\n"); err != nil {
		tmp.Close()
		return "", fmt.Errorf("natsembed: writing the token file: %w", err)
	}
	if err := tmp.Sync(); err != nil {
		tmp.Close()
		return "", fmt.Errorf("natsembed: writing the token file: %w", err)
	}
	if err := tmp.Close(); err != nil {
		return "", fmt.Errorf("natsembed: writing the token file: %w", err)
	}
	// A link, unlike a rename, fails when path exists: the first writer's
	// token stays, and the others read it.
	if err := os.Link(tmp.Name(), path); err != nil && !errors.Is(err, fs.ErrExist) {
		return "", fmt.Errorf("natsembed: writing the token file: %w", err)
	}
	return ReadToken(path)
}

// ReadToken returns the token kept in the file at path (LoadOrCreateToken),
// without creating anything: an error matching ErrNoToken when there is
// no file, and an error when the file is open to other users or holds no
// token. The error never holds the token.
func ReadToken(path string) (string, error) {
	fi, err := os.Stat(path)
	if errors.Is(err, fs.ErrNotExist) {
		return "", fmt.Errorf("%w: %s", ErrNoToken, path)
	}
	if err != nil {
		return "", fmt.Errorf("natsembed: token file: %w", err)
	}
	if !fi.Mode().IsRegular() {
		return "", fmt.Errorf("natsembed: token file %s is not a regular file", path)
	}
	if perm := fi.Mode().Perm(); perm&0o077 != 0 {
		return "", fmt.Errorf("natsembed: token file %s has mode %04o: other users may read it; remove it (a new token is made at the next start of the server) or make it 0600", path, perm)
	}
	raw, err := os.ReadFile(path)
	if err != nil {
		return "", fmt.Errorf("natsembed: token file: %w", err)
	}
	tok := strings.TrimSpace(string(raw))
	if err := checkToken(tok); err != nil {
		return "", fmt.Errorf("natsembed: token file %s: %w", path, err)
	}
	return tok, nil
}

// checkToken refuses a token the server could not compare as it was
// given: empty, or holding white space or control characters.
func checkToken(tok string) error {
	if tok == "" {
		return errors.New("natsembed: empty token")
	}
	for _, r := range tok {
		if r <= ' ' || r == 0x7f {
			return errors.New("natsembed: the token holds white space or a control character")
		}
	}
	return nil
}
