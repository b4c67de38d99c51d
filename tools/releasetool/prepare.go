package main

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"golang.org/x/mod/modfile"
	"golang.org/x/mod/module"
	"golang.org/x/mod/semver"
	"golang.org/x/mod/sumdb/dirhash"
	modzip "golang.org/x/mod/zip"
)

// prepare makes the working tree the release commit of version: every
// requirement between the project's modules (and go.work's replacements of
// them) at version, every module tidied, go.sum holding the hashes of the
// sibling modules as the tagged commit will hold them, CHANGELOG.md's
// Unreleased section under version's heading, and api/released/ the
// listing of this release. It prints the tags to create, in order.
func prepare(version string) error {
	if !semver.IsValid(version) || semver.Canonical(version) != version {
		return fmt.Errorf("%q is not a release version: vMAJOR.MINOR.PATCH, as v0.3.0 (or v0.3.0-rc.1)", version)
	}
	if m := semver.Major(version); m != "v0" && m != "v1" {
		return fmt.Errorf("%s needs module paths ending in /%s; the modules have none", version, m)
	}
	if last, err := os.ReadFile(filepath.Join(apiDir, "released", "VERSION")); err == nil {
		if l := strings.TrimSpace(string(last)); semver.Compare(version, l) <= 0 {
			return fmt.Errorf("%s is not after the last release, %s (api/released/VERSION)", version, l)
		}
	}
	if status, err := git("status", "--porcelain"); err != nil {
		return err
	} else if status != "" {
		return fmt.Errorf("the working tree has changes; start from a clean checkout:\n%s", status)
	}
	step("the API listing is up to date (tools/api -check)")
	if err := apiCommand(true); err != nil {
		return err
	}

	step("CHANGELOG.md: Unreleased becomes " + version)
	if err := changelogRelease(version); err != nil {
		return err
	}
	step("api/released/: the listing of " + version)
	if err := snapshotAPI(version); err != nil {
		return err
	}

	step("every requirement between the modules at " + version)
	paths := map[string]mod{}
	for _, m := range modules {
		paths[m.path] = m
	}
	for _, m := range modules {
		mf, err := readModFile(m)
		if err != nil {
			return err
		}
		var args []string
		for _, r := range mf.Require {
			if _, ok := paths[r.Mod.Path]; ok && r.Mod.Path != m.path {
				args = append(args, "-require="+r.Mod.Path+"@"+version)
			}
		}
		if len(args) > 0 {
			if err := goCmd(m.dir, nil, append([]string{"mod", "edit"}, args...)...); err != nil {
				return err
			}
		}
	}
	if err := workReplacements(version, paths); err != nil {
		return err
	}

	step("go mod tidy in every released module (the siblings replaced by their folders meanwhile)")
	for _, m := range modules {
		if !m.released {
			continue // examples and uitest: only their requirement moves
		}
		if err := tidy(m); err != nil {
			return err
		}
	}

	step("every module builds in the workspace")
	build := []string{"build"}
	for _, m := range modules {
		build = append(build, "./"+strings.TrimPrefix(m.dir+"/...", "./"))
	}
	if err := goCmd(".", nil, build...); err != nil {
		return err
	}

	step("go.sum: the hashes of the sibling modules at " + version)
	for i, m := range modules {
		if !m.released {
			continue
		}
		zipSum, modSum, err := moduleSums(m, version)
		if err != nil {
			return err
		}
		for _, later := range modules[i+1:] {
			if err := addSums(later, m.path, version, zipSum, modSum); err != nil {
				return err
			}
		}
	}

	fmt.Fprintf(os.Stderr, "\nReady. Review, commit (git commit -am 'Release %s'), then create and push these tags, in this order:\n", version)
	for _, m := range modules {
		if m.released {
			fmt.Println(tagOf(m, version))
		}
	}
	return nil
}

func tagOf(m mod, version string) string {
	if m.dir == "." {
		return version
	}
	return m.dir + "/" + version
}

func step(s string) { fmt.Fprintln(os.Stderr, "--- "+s) }

func git(args ...string) (string, error) {
	out, err := exec.Command("git", args...).Output()
	if err != nil {
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			return "", fmt.Errorf("git %s: %v: %s", strings.Join(args, " "), err, ee.Stderr)
		}
		return "", err
	}
	return strings.TrimSpace(string(out)), nil
}

// goCmd runs the go command in dir with extra environment.
func goCmd(dir string, env []string, args ...string) error {
	cmd := exec.Command("go", args...)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), env...)
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("(cd %s && go %s): %w", dir, strings.Join(args, " "), err)
	}
	return nil
}

func readModFile(m mod) (*modfile.File, error) {
	name := filepath.Join(m.dir, "go.mod")
	data, err := os.ReadFile(name)
	if err != nil {
		return nil, err
	}
	return modfile.Parse(name, data, nil)
}

// workReplacements points go.work's replacements of the project's modules
// (which the workspace needs for a module that is required at a version)
// at version.
func workReplacements(version string, paths map[string]mod) error {
	data, err := os.ReadFile("go.work")
	if err != nil {
		return err
	}
	wf, err := modfile.ParseWork("go.work", data, nil)
	if err != nil {
		return err
	}
	var args []string
	for _, r := range wf.Replace {
		if _, ok := paths[r.Old.Path]; ok && r.Old.Version != "" && r.Old.Version != version {
			args = append(args, "-dropreplace="+r.Old.Path+"@"+r.Old.Version,
				"-replace="+r.Old.Path+"@"+version+"="+r.New.Path)
		}
	}
	if len(args) == 0 {
		return nil
	}
	return goCmd(".", nil, append([]string{"work", "edit"}, args...)...)
}

// tidy runs go mod tidy in m outside the workspace, with the project's
// other modules replaced by their folders for the time of it (the version
// they are required at is not published yet).
func tidy(m mod) error {
	mf, err := readModFile(m)
	if err != nil {
		return err
	}
	replaced := map[string]bool{}
	for _, r := range mf.Replace {
		replaced[r.Old.Path] = true
	}
	var add, drop []string
	for _, o := range modules {
		if o.path == m.path || replaced[o.path] {
			continue
		}
		rel, err := filepath.Rel(m.dir, o.dir)
		if err != nil {
			return err
		}
		if !strings.HasPrefix(rel, ".") {
			rel = "./" + rel
		}
		add = append(add, "-replace="+o.path+"="+rel)
		drop = append(drop, "-dropreplace="+o.path)
	}
	if len(add) > 0 {
		if err := goCmd(m.dir, nil, append([]string{"mod", "edit"}, add...)...); err != nil {
			return err
		}
	}
	if err := goCmd(m.dir, []string{"GOWORK=off"}, "mod", "tidy"); err != nil {
		return err
	}
	if len(drop) > 0 {
		return goCmd(m.dir, nil, append([]string{"mod", "edit"}, drop...)...)
	}
	return nil
}

// moduleSums returns the go.sum hashes of m at version (its zip and its
// go.mod) as the go command will compute them from the commit holding the
// working tree: the files git tracks (and the new ones it does not ignore),
// minus nested modules, as the module proxy zips them.
func moduleSums(m mod, version string) (zipSum, modSum string, err error) {
	list, err := git("ls-files", "--cached", "--others", "--exclude-standard", "-z", "--", m.dir)
	if err != nil {
		return "", "", err
	}
	prefix := ""
	if m.dir != "." {
		prefix = m.dir + "/"
	}
	var files []modzip.File
	haveLicense := false
	for name := range strings.SplitSeq(strings.Trim(list, "\x00"), "\x00") {
		if name == "" {
			continue
		}
		if _, err := os.Lstat(name); errors.Is(err, os.ErrNotExist) {
			continue
		}
		rel := strings.TrimPrefix(name, prefix)
		files = append(files, diskFile{path: rel, name: name})
		haveLicense = haveLicense || rel == "LICENSE"
	}
	// The go command adds the repository's LICENSE to a module in a
	// subdirectory that has none.
	if !haveLicense && prefix != "" {
		if _, err := os.Stat("LICENSE"); err == nil {
			if tracked, _ := git("ls-files", "LICENSE"); tracked != "" {
				files = append(files, diskFile{path: "LICENSE", name: "LICENSE"})
			}
		}
	}
	var zip bytes.Buffer
	if err := modzip.Create(&zip, module.Version{Path: m.path, Version: version}, files); err != nil {
		return "", "", err
	}
	tmp, err := os.CreateTemp("", "idem-release-*.zip")
	if err != nil {
		return "", "", err
	}
	defer os.Remove(tmp.Name())
	if _, err := tmp.Write(zip.Bytes()); err != nil {
		tmp.Close()
		return "", "", err
	}
	if err := tmp.Close(); err != nil {
		return "", "", err
	}
	if zipSum, err = dirhash.HashZip(tmp.Name(), dirhash.Hash1); err != nil {
		return "", "", err
	}
	gomod, err := os.ReadFile(filepath.Join(m.dir, "go.mod"))
	if err != nil {
		return "", "", err
	}
	modSum, err = dirhash.Hash1([]string{"go.mod"}, func(string) (io.ReadCloser, error) {
		return io.NopCloser(bytes.NewReader(gomod)), nil
	})
	return zipSum, modSum, err
}

type diskFile struct{ path, name string }

func (f diskFile) Path() string                 { return f.path }
func (f diskFile) Lstat() (os.FileInfo, error)  { return os.Lstat(f.name) }
func (f diskFile) Open() (io.ReadCloser, error) { return os.Open(f.name) }

// addSums puts the hashes of dep at version into m's go.sum when m requires
// dep (and does not replace it), in place of any other version's.
func addSums(m mod, dep, version, zipSum, modSum string) error {
	mf, err := readModFile(m)
	if err != nil {
		return err
	}
	required := slices.ContainsFunc(mf.Require, func(r *modfile.Require) bool { return r.Mod.Path == dep })
	replaced := slices.ContainsFunc(mf.Replace, func(r *modfile.Replace) bool { return r.Old.Path == dep })
	if !required || replaced {
		return nil
	}
	name := filepath.Join(m.dir, "go.sum")
	data, err := os.ReadFile(name)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	var lines []string
	for _, l := range splitLines(data) {
		if f := strings.Fields(l); len(f) > 0 && f[0] == dep {
			continue
		}
		lines = append(lines, l)
	}
	at := len(lines)
	for i, l := range lines {
		if strings.Fields(l)[0] > dep {
			at = i
			break
		}
	}
	lines = slices.Insert(lines, at,
		dep+" "+version+" "+zipSum,
		dep+" "+version+"/go.mod "+modSum)
	return os.WriteFile(name, []byte(strings.Join(lines, "\n")+"\n"), 0o644)
}

// snapshotAPI copies the API listings to api/released/, the listing of the
// last release that CI compares the code with.
func snapshotAPI(version string) error {
	dir := filepath.Join(apiDir, "released")
	if err := os.RemoveAll(dir); err != nil {
		return err
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	for _, m := range modules {
		if m.api == "" {
			continue
		}
		data, err := os.ReadFile(filepath.Join(apiDir, m.api+".txt"))
		if err != nil {
			return err
		}
		if err := os.WriteFile(filepath.Join(dir, m.api+".txt"), data, 0o644); err != nil {
			return err
		}
	}
	return os.WriteFile(filepath.Join(dir, "VERSION"), []byte(version+"\n"), 0o644)
}

// changelogRelease turns CHANGELOG.md's "## [Unreleased]" section into
// "## [version] - date" under a new, empty Unreleased section.
func changelogRelease(version string) error {
	data, err := os.ReadFile("CHANGELOG.md")
	if err != nil {
		return err
	}
	const head = "## [Unreleased]"
	s := string(data)
	i := strings.Index(s, head+"\n")
	if i < 0 {
		return errors.New("CHANGELOG.md has no \"## [Unreleased]\" section")
	}
	dated := fmt.Sprintf("## [%s] - %s", strings.TrimPrefix(version, "v"), time.Now().UTC().Format("2006-01-02"))
	s = s[:i] + head + "\n\n" + dated + "\n" + s[i+len(head)+1:]
	return os.WriteFile("CHANGELOG.md", []byte(s), 0o644)
}
