package main

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"
)

// transcriptMarker precedes, on the line before its opening fence, a
// transcript in the docs that TestDocTranscripts replays against a fresh
// `idem-demo serve -seed N`:
//
//	<!-- transcript: idem-demo serve -seed 7 -->
var transcriptMarker = regexp.MustCompile(`^<!-- transcript: idem-demo serve -seed (\d+) -->$`)

// runOutputMarker precedes, on the line before its opening fence, rows of
// `idem-demo run`'s table that TestRunScenarios finds in its output (spaces
// aside).
const runOutputMarker = "<!-- run output: idem-demo run -->"

// docRunOutputs returns the rows of the marked run outputs of README.md
// and docs/*.md, each with where it is.
func docRunOutputs(t *testing.T) map[string]string {
	t.Helper()
	files, err := filepath.Glob("../../docs/*.md")
	if err != nil {
		t.Fatal(err)
	}
	rows := map[string]string{}
	for _, file := range append([]string{"../../README.md"}, files...) {
		b, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		lines := strings.Split(string(b), "\n")
		for i := range lines {
			if lines[i] != runOutputMarker {
				continue
			}
			if i+1 >= len(lines) || lines[i+1] != "```" {
				t.Fatalf("%s:%d: the run output marker is not followed by a fence (```)", file, i+1)
			}
			for j := i + 2; j < len(lines) && lines[j] != "```"; j++ {
				if strings.TrimSpace(lines[j]) != "" {
					rows[lines[j]] = fmt.Sprintf("%s:%d", strings.TrimPrefix(file, "../../"), j+1)
				}
			}
		}
	}
	return rows
}

// transcriptBase is the address the transcripts show (serve's default).
const transcriptBase = "http://127.0.0.1:8080"

// transcript is one marked block: the commands and what each printed.
type transcript struct {
	file string
	line int
	seed string
	cmds []transcriptCmd
}

type transcriptCmd struct {
	line int    // in the file
	cmd  string // after "$ "
	out  string // the lines after it, up to the next command, trimmed
}

// docTranscripts returns the marked transcripts of README.md and docs/*.md.
func docTranscripts(t *testing.T) []transcript {
	t.Helper()
	files, err := filepath.Glob("../../docs/*.md")
	if err != nil {
		t.Fatal(err)
	}
	var all []transcript
	for _, file := range append([]string{"../../README.md"}, files...) {
		b, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		lines := strings.Split(string(b), "\n")
		for i := 0; i < len(lines); i++ {
			m := transcriptMarker.FindStringSubmatch(lines[i])
			if m == nil {
				continue
			}
			name := strings.TrimPrefix(file, "../../")
			if i+1 >= len(lines) || lines[i+1] != "```" {
				t.Fatalf("%s:%d: the transcript marker is not followed by a fence (```)", name, i+1)
			}
			tr := transcript{file: name, line: i + 1, seed: m[1]}
			var cur *transcriptCmd
			for i += 2; i < len(lines) && lines[i] != "```"; i++ {
				if cmd, ok := strings.CutPrefix(lines[i], "$ "); ok {
					tr.cmds = append(tr.cmds, transcriptCmd{line: i + 1, cmd: cmd})
					cur = &tr.cmds[len(tr.cmds)-1]
					continue
				}
				if cur == nil {
					t.Fatalf("%s:%d: a transcript starts with a command ($ ...)", name, i+1)
				}
				cur.out += lines[i] + "\n"
			}
			for j := range tr.cmds {
				tr.cmds[j].out = strings.Trim(tr.cmds[j].out, "\n")
			}
			all = append(all, tr)
		}
	}
	return all
}

// The marked transcripts of the docs are what the demo answers, byte for
// byte (Date headers aside): each replayed, command by command, against a
// fresh `idem-demo serve` with the transcript's seed.
func TestDocTranscripts(t *testing.T) {
	t.Parallel()
	transcripts := docTranscripts(t)
	accepted := false
	for _, tr := range transcripts {
		for _, c := range tr.cmds {
			accepted = accepted || strings.HasPrefix(c.out, "HTTP/1.1 202 Accepted")
		}
	}
	if !accepted {
		t.Errorf("no marked transcript in README.md or docs/ shows a 202 Accepted (the status URL)")
	}
	for _, tr := range transcripts {
		t.Run(fmt.Sprintf("%s:%d", tr.file, tr.line), func(t *testing.T) {
			t.Parallel()
			base := startServe(t, "-seed", tr.seed)
			for _, c := range tr.cmds {
				got, err := runTranscriptCmd(t.Context(), base, c.cmd)
				if err != nil {
					t.Fatalf("%s:%d: %s: %v", tr.file, c.line, c.cmd, err)
				}
				if got != c.out {
					t.Errorf("%s:%d: %s\nthe docs show:\n%s\nthe demo answers:\n%s", tr.file, c.line, c.cmd, c.out, got)
				}
			}
		})
	}
}

// runTranscriptCmd runs one command of a transcript and returns what it
// prints: sleep N, or curl with the flags the docs use (-s, -i, -si, -H,
// -d, -X, --max-time N), sent to base instead of transcriptBase. An
// unquoted # starts a comment.
func runTranscriptCmd(ctx context.Context, base, cmdline string) (string, error) {
	words, err := shellWords(cmdline)
	if err != nil {
		return "", err
	}
	switch {
	case len(words) == 2 && words[0] == "sleep":
		n, err := strconv.Atoi(words[1])
		if err != nil {
			return "", err
		}
		time.Sleep(time.Duration(n) * time.Second)
		return "", nil
	case len(words) == 0 || words[0] != "curl":
		return "", fmt.Errorf("not sleep or curl")
	}
	var (
		target, method, body string
		include              bool
		header               = http.Header{}
		maxTime              time.Duration
	)
	for i := 1; i < len(words); i++ {
		w := words[i]
		next := func() (string, error) {
			if i+1 >= len(words) {
				return "", fmt.Errorf("%s needs a value", w)
			}
			i++
			return words[i], nil
		}
		var v string
		switch w {
		case "-s":
		case "-i", "-si", "-is":
			include = true
		case "-H", "-d", "-X", "--max-time":
			if v, err = next(); err != nil {
				return "", err
			}
		default:
			if strings.HasPrefix(w, "-") || target != "" {
				return "", fmt.Errorf("curl argument %q is not one the transcripts use", w)
			}
			target = w
		}
		switch w {
		case "-H":
			name, value, ok := strings.Cut(v, ": ")
			if !ok {
				return "", fmt.Errorf("header %q", v)
			}
			header.Add(name, value)
		case "-d":
			body = v
		case "-X":
			method = v
		case "--max-time":
			n, err := strconv.Atoi(v)
			if err != nil {
				return "", err
			}
			maxTime = time.Duration(n) * time.Second
		}
	}
	rest, ok := strings.CutPrefix(target, transcriptBase)
	if !ok {
		return "", fmt.Errorf("URL %q is not under %s", target, transcriptBase)
	}
	if method == "" {
		method = "GET"
	}
	if body != "" {
		if method == "GET" {
			method = "POST"
		}
		if header.Get("Content-Type") == "" {
			header.Set("Content-Type", "application/x-www-form-urlencoded") // as curl -d
		}
	}
	req, err := http.NewRequestWithContext(ctx, method, base+rest, strings.NewReader(body))
	if err != nil {
		return "", err
	}
	req.Header = header
	conn, err := (&net.Dialer{}).DialContext(ctx, "tcp", req.URL.Host)
	if err != nil {
		return "", err
	}
	defer conn.Close()
	if maxTime > 0 {
		_ = conn.SetDeadline(time.Now().Add(maxTime))
	}
	if err := req.Write(conn); err != nil {
		return "", err
	}
	head, resp, err := readRawResponse(bufio.NewReader(conn), req)
	if maxTime > 0 && errors.Is(err, os.ErrDeadlineExceeded) {
		return "", nil // curl -s gives up silently
	}
	if err != nil {
		return "", err
	}
	out, err := io.ReadAll(resp.Body)
	if err != nil {
		return "", err
	}
	if include {
		out = append([]byte(head+"\n"), out...)
	}
	return strings.Trim(string(out), "\n"), nil
}

// readRawResponse reads a response's status line and headers as sent
// (in their order, CRLF as LF, without Date) and the response.
func readRawResponse(br *bufio.Reader, req *http.Request) (string, *http.Response, error) {
	var raw bytes.Buffer
	var head strings.Builder
	for {
		line, err := br.ReadString('\n')
		if err != nil {
			return "", nil, err
		}
		raw.WriteString(line)
		line = strings.TrimRight(line, "\r\n")
		if line == "" {
			break
		}
		if !strings.HasPrefix(line, "Date: ") {
			head.WriteString(line + "\n")
		}
	}
	resp, err := http.ReadResponse(bufio.NewReader(io.MultiReader(&raw, br)), req)
	return head.String(), resp, err
}

// shellWords splits a command line as sh does for the transcripts' forms:
// words separated by spaces, '...' and "..." quoting, and a # comment
// after a space.
func shellWords(s string) ([]string, error) {
	var words []string
	var w strings.Builder
	inWord := false
	for i := 0; i < len(s); i++ {
		switch c := s[i]; {
		case c == ' ' || c == '\t':
			if inWord {
				words = append(words, w.String())
				w.Reset()
				inWord = false
			}
		case c == '#' && !inWord:
			return words, nil
		case c == '\'' || c == '"':
			end := strings.IndexByte(s[i+1:], c)
			if end < 0 {
				return nil, fmt.Errorf("unterminated %c", c)
			}
			w.WriteString(s[i+1 : i+1+end])
			i += end + 1
			inWord = true
		default:
			w.WriteByte(c)
			inWord = true
		}
	}
	if inWord {
		words = append(words, w.String())
	}
	return words, nil
}
