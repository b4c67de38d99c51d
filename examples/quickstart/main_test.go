package main

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"os"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
)

// codeBlock is a fenced code block of README.md.
type codeBlock struct{ lang, text string }

// TestMain stops the package at once, with one line and exit status 1, when
// no server answers, as the examples module's other packages do.
func TestMain(m *testing.M) {
	url := os.Getenv("DATABASE_URL")
	if url == "" {
		url = "postgres://postgres@localhost:5432/postgres"
	}
	conn, err := pgx.Connect(context.Background(), url)
	if err != nil {
		reason := strings.Join(strings.Fields(err.Error()), " ") // one line: pgx's message may span several
		fmt.Fprintf(os.Stderr, "examples/quickstart: no PostgreSQL server at DATABASE_URL or localhost:5432; stopping (%s)\n", reason)
		os.Exit(1)
	}
	_ = conn.Close(context.Background())
	os.Exit(m.Run())
}

// readme returns the code blocks of the repository's README.md.
func readme(t *testing.T) []codeBlock {
	t.Helper()
	f, err := os.Open("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var blocks []codeBlock
	var block *strings.Builder
	var lang string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := sc.Text()
		switch {
		case block == nil && strings.HasPrefix(line, "```"):
			block, lang = &strings.Builder{}, strings.TrimPrefix(line, "```")
		case block != nil && line == "```":
			blocks = append(blocks, codeBlock{lang, block.String()})
			block = nil
		case block != nil:
			block.WriteString(line + "\n")
		}
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return blocks
}

// TestQuickstart runs the program and checks that README.md shows it as it
// is, followed by what it prints.
func TestQuickstart(t *testing.T) {
	src, err := os.ReadFile("main.go")
	if err != nil {
		t.Fatal(err)
	}
	blocks := readme(t)
	program, output := -1, -1
	for i, b := range blocks {
		switch {
		case b.lang == "go" && b.text == string(src):
			program = i
		case b.lang == "text" && program >= 0 && output < 0:
			output = i
		}
	}
	if program < 0 || output < 0 {
		t.Fatal("README.md does not show examples/quickstart/main.go as it is, and then its output in a text block: copy them there")
	}

	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout := os.Stdout
	os.Stdout = w
	printed := make(chan string)
	go func() {
		b, _ := io.ReadAll(r)
		printed <- string(b)
	}()
	main()
	os.Stdout = stdout
	_ = w.Close()
	if got, want := <-printed, blocks[output].text; got != want {
		t.Errorf("the program printed\n%s\nREADME.md shows\n%s", got, want)
	}
}
