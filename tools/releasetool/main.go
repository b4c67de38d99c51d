// Command releasetool is what tools/release, tools/api and CI run: it lists
// the public API of the released modules (api), prepares the working tree
// for a release (prepare) and checks the tracked files (hygiene). Run it
// from the repository root through those scripts:
//
//	tools/api             write api/*.txt, the listing of the public API
//	tools/api -check      compare with the committed listing (CI)
//	tools/release VERSION prepare the working tree for VERSION
//
// It lives in the tools module, outside the workspace, so the library's
// go.mod never sees x/mod or x/tools.
package main

import (
	"fmt"
	"os"
)

// mod is one module of the repository.
type mod struct {
	path     string // module path
	dir      string // directory relative to the repository root, "." for the root
	released bool   // tagged at every release
	api      string // name of its listing in api/, "" when it has no public package
}

// modules are the project's modules; the released ones in the order they
// are tagged (each requires only modules before it).
var modules = []mod{
	{path: "github.com/pgidem/idem", dir: ".", released: true, api: "idem"},
	{path: "github.com/pgidem/idem/internal/rpcproto", dir: "internal/rpcproto", released: true},
	{path: "github.com/pgidem/idem/idemgrpc", dir: "idemgrpc", released: true, api: "idemgrpc"},
	{path: "github.com/pgidem/idem/idemconnect", dir: "idemconnect", released: true, api: "idemconnect"},
	{path: "github.com/pgidem/idem/cmd", dir: "cmd", released: true},
	{path: "github.com/pgidem/idem/examples", dir: "examples"},
	{path: "github.com/pgidem/idem/uitest", dir: "uitest"},
}

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: releasetool api [-check] | prepare VERSION | hygiene")
		os.Exit(2)
	}
	var err error
	switch os.Args[1] {
	case "api":
		check := len(os.Args) > 2 && os.Args[2] == "-check"
		err = apiCommand(check)
	case "prepare":
		if len(os.Args) != 3 {
			fmt.Fprintln(os.Stderr, "usage: tools/release VERSION (for example v0.3.0)")
			os.Exit(2)
		}
		err = prepare(os.Args[2])
	case "hygiene":
		err = hygiene()
	default:
		fmt.Fprintf(os.Stderr, "releasetool: unknown command %q\n", os.Args[1])
		os.Exit(2)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "releasetool "+os.Args[1]+": "+err.Error())
		os.Exit(1)
	}
}
