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
	"path"
	"slices"

	"golang.org/x/mod/modfile"
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

// checkModules fails when go.work's modules are not the ones listed in
// modules (a module added, moved or removed): the list must follow.
func checkModules() error {
	data, err := os.ReadFile("go.work")
	if err != nil {
		return err
	}
	wf, err := modfile.ParseWork("go.work", data, nil)
	if err != nil {
		return err
	}
	var used, listed []string
	for _, u := range wf.Use {
		used = append(used, path.Clean(u.Path))
	}
	for _, m := range modules {
		listed = append(listed, m.dir)
	}
	slices.Sort(used)
	slices.Sort(listed)
	if !slices.Equal(used, listed) {
		return fmt.Errorf("go.work uses %v, but tools/releasetool/main.go lists the modules %v: update its list (and the release order)", used, listed)
	}
	return nil
}

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: releasetool api [-check] | prepare VERSION | hygiene")
		os.Exit(2)
	}
	err := checkModules()
	if err != nil {
		fmt.Fprintln(os.Stderr, "releasetool: "+err.Error())
		os.Exit(1)
	}
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
